#!/usr/bin/env bash
# Steps run on the GPU machine after ../shared/gpu/stage_vllm.py's parts are unpacked into
# /tmp/site (see ../shared/gpu/README.md). Usage: bash bench/gpu_run.sh STEP [STEP ...]
#   stagepart  copy the staging parts this call carries (STAGE_FROM, default .stage/fi: the
#            `*.tar.xz.part*` of ../shared/gpu/stage_vllm.py; carry one part per call) to /tmp/stage (STAGE_DIR)
#   unstage  check every part in /tmp/stage against the staging's SHA256SUMS (STAGE_SUMS, default the
#            `*.SHA256SUMS` in STAGE_FROM; carry it with the last part) and unpack them into /tmp/site
#            (STAGE_SITE); a missing or damaged part stops the command and leaves /tmp/site as it was.
#            A session: `stagepart` per part, then `stagepart unstage install ...` with the last one
#   install  install the atom wheel carried in .stage/tools into /tmp/site (entry points visible)
#   serve-deps  wheels carried in .stage/serve (uvicorn, prometheus-fastapi-instrumentator, aiohttp,
#            ...: `pip download --no-deps --python-version 3.12` of what `vllm serve` and its
#            benchmark client import but the staged vLLM strips) -> /tmp/site-serve
#   facts    bench/vllm_facts.py               -> $OUT/facts.txt
#   demo     scripts/demo.py (atom on vs off)  -> $OUT/demo.txt
#   tests    GPU-marked tests (GPU_TESTS, default tests/) -> $OUT/gpu_tests.txt (unbuffered; at the limit,
#            GPU_TESTS_TIMEOUT s (540), pytest is interrupted, not killed: the failures so far and their reasons
#            are still printed)
#   ops      bench/ops.py (ops_memory.py then ops_compute.py) -> $OUT/ops.txt, ops_*.json
#   e2e      ../shared/gpu/bench_vllm_baseline.py (carried in .stage/tools) on its dense Qwen3
#            (E2E_MODEL=tiny-qwen3moe for the MoE one), stock (ATOM_DISABLE_VLLM_PLUGIN=1) then
#            atom, same process settings -> $OUT/e2e
#   attn     bench/attention_e2e.py: vLLM's own Qwen3 (Qwen3-8B dims, 4 layers, bf16) on atom's
#            MHA backend vs vLLM's default, cudagraph_mode PIECEWISE and FULL_AND_PIECEWISE
#            (token agreement, logprob diff, decode tok/s, batch-1 ms/token) -> $OUT/attn_e2e_*.json
#            (ATTN_ARCH=deepseek: vLLM's DeepSeek-V3 attention dims, dense MLPs, on atom's MLA backend
#            vs vLLM's default MLA backend; ATTN_MODES=PIECEWISE / =FULL_AND_PIECEWISE splits it over two calls if 10 min is tight;
#            the checkpoint is built once under /tmp/models)
#   e2e2     bench/e2e.py (realistic dims, random weights; stock and atom engines in one call)
#            -> $OUT/e2e2/e2e.json, e2e.txt (markdown table at the end), work/ (per-side logs).
#            Cells from E2E_ARGS (default: --models dense --lengths 128/128 --concurrency 1,32,256);
#            E2E_BUDGET seconds (default 520) stops starting new cells. Checkpoints are cached in
#            /tmp/atom-e2e-models on the machine (first build: ~0.5-2 min per model).
#   table    the docs/performance.md end-to-end table for one model (TABLE_MODEL: dense | moe | mla;
#            TABLE_LAYERS default 16 / 16 / 4): bench/e2e.py through one `vllm serve` per side (stock
#            first), 128/128 and 1024/1024 (TABLE_LENGTHS) at concurrency 1, 32, 256 (TABLE_CONC):
#            output tok/s, TTFT, TPOT per cell, greedy agreement through the servers (256 prompts),
#            the batch throughput of each cell (--serve-batch: C prompts in one non-streaming request),
#            and one profiled cell (TABLE_PROFILE, default 128/128@256; empty: none) -> kernel time by category.
#            Other checkpoints under /tmp/atom-e2e-models are deleted first (disk). TABLE_ARGS adds
#            e2e.py options (e.g. "--tp 2 --ep"). -> $OUT/table_<model>/e2e.json, e2e.txt, work/
#   agree    bench/agreement.py (AGREE_ARGS; default the dense model, stock fp32 as the reference,
#            stock/atom in fp32, bf16 eager and bf16 with CUDA graphs) -> $OUT/agree/agree.json, .txt
#   fusion   the QK-norm fusion A/B (bench/NOTES.md entry 5), ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION=0
#            then 1 -> $OUT/fusion/{0,1}.{txt,json}
#   elementwise  the ATOM_COMPILE_ELEMENTWISE A/B: =kernels (one atom-kernel node per norm / RoPE /
#            SiLU-and-mul) then =inductor (fused by Inductor) -> $OUT/elementwise/{kernels,inductor}.{txt,json}
#            Both: ab_profile below, bench/profile_e2e.py --side atom on FUSION_MODEL (default the
#            `table` step's dense checkpoint), 128/128 at C=256.
#   fp8gemm  bench/fp8_gemm.py: the block-fp8 GEMM kernel table (atom W8A16 / W8A8 vs stock's CUTLASS and
#            DeepGEMM vs bf16 cuBLAS; FP8GEMM_ARGS, default --sweep) -> $OUT/fp8_gemm.json, .txt
#   ab       bench/ab.py (the speed protocol: sides alive at once on the GPU, interleaved windows,
#            bootstrap intervals, clocks) on AB_MODEL (dense | moe | mla | mla8: DeepSeek-V3 at one TP-8 rank's
#            shapes, its 256 experts, bench/NOTES.md 79; AB_LAYERS default 4; mla:
#            AB_MLA_EXPERTS routed experts, default 64, DeepSeek-V3's 256; built under
#            /tmp/atom-e2e-models), 128/128 at C=AB_CONC (default 32), AB_ROUNDS (5)
#            windows of AB_WINDOW s (15), after AB_WARMUP s (5) unmeasured per side, cell and launch.
#            Sides: stock (atom installed, ATOM_DISABLE_VLLM_PLUGIN=1),
#            atom (the wheel in .stage/tools, installed into /tmp/atom-new) and, when
#            .stage/tools/old holds a wheel, old (installed into /tmp/atom-old): a before/after
#            check of one atom change. Each side has its own compile cache. AB_FP8=1: the checkpoint
#            written in 128x128 block fp8 as its weights are drawn (bench/e2e_models.py build_model block_fp8;
#            no bf16 copy on disk, so Qwen3-30B-A3B dims at all 48 layers fit; other models' checkpoints go
#            first when under 40 GiB are free). AB_DUMMY=1: no weights on disk, the config and tokenizer only, and
#            every side loads with load_format "dummy" (vLLM draws the weights, uniform in +-1e-3; each side's worker
#            then draws the MoE routers, the same on every side: ab_worker.draw_routers); label and folder suffixed -dummy. For full-depth models whose checkpoint would not fit the disk. AB_ROUNDS=0: start the sides and stop (fills the
#            JIT caches when a cold start and the measurement do not fit one command). With AB_FP8=1 the atom sides run
#            with ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1: atom's model (by default atom steps aside for dense and Qwen3-MoE block fp8 on NVIDIA,
#            and its atom side would run stock's). AB_ENGINE: JSON engine
#            arguments for every side (e.g. {"max_num_batched_tokens": 8192}: no change to a 128/128 cell's
#            steps up to C=64, half of stock's DeepGEMM warm-up shapes). AB_ROUTER_SKEW (MoE models, default 0:
#            uniform): routers with Zipf-like expert popularity (bench/e2e_models.py router_row_scales; 0.2
#            puts the hottest expert at ~3.5x the mean load), checkpoint and label suffixed -zipf<skew>. AB_CONC may be
#            a comma list (cells interleaved in the same engines). AB_LAUNCHES (default 1): fresh engine launches per side in
#            this one command, AB_ROUNDS rounds each; AB_FIRST_SHIFT=N rotates the first launch's start order by N sides
#            (a command that continues another's launches: 1, then 2 for three sides). AB_SIDES (comma list of stock, atom, old; default all):
#            start only those sides (AB_SWITCH_SIDE's name included), e.g. AB_ROUNDS=0 AB_SIDES=stock then AB_SIDES=atom: a block-fp8 model's cold
#            fill takes longer than one command (stock's DeepGEMM warm-up: 1068 shapes, 164 s cold on the 4-layer
#            MoE; the sides start one after another). AB_FILL_PARALLEL=1 (bench/ab.py --overlap-starts): a side
#            starts once the one before has sized its KV cache, so their JIT warm-ups overlap and one command
#            fills both sides of a full-depth fp8 cell (AB_ROUNDS=0); with rounds every launch starts so, and
#            the windows begin once all sides are ready. With AB_DUMMY=1 and fp8, a later side's load holds its
#            weights plus 3 bytes per element of its largest fp8 parameter (vLLM's dummy loader draws each through
#            an fp16 copy; 21 GiB for a 256-expert DeepSeek-V3 w13) in its allocator until its KV sizing: keep that
#            under what the first side leaves (AB_MLA_EXPERTS=256 fits at AB_LAYERS=4, not 5: bench/NOTES.md 75;
#            bench/ab.py checks it before starting). AB_FRESH_COMPILE=1:
#            every side's torch.compile cache removed before each launch (bench/ab.py --fresh-compile: each launch
#            compiles and autotunes anew, an independent draw; DeepGEMM / FlashInfer JIT caches stay). AB_SWITCH_SIDE=NAME:KEY=VALUE,... (a comma inside a value: \,): one more side, atom's
#            new wheel with those variables (e.g. cublas:ATOM_BF16_GEMV=0; several separated by ';'). AB_ARRIVALS=continuous: C requests
#            kept in flight instead of batches of C (most steps mixed, as in online serving; bench/ab.py --arrivals),
#            files suffixed -cont. -> $OUT/ab_<model>[-cont][_c<C>].json, .txt, .logs.txt
#   archs    issue #17: the architectures atom serves that had not run on a GPU, each of ARCHS (default
#            llama,mixtral; also glm4moe, gptoss: bench/e2e_models.py, random bf16 weights at Llama-3.1-8B,
#            Mixtral-8x7B, GLM-4.5-Air, GPT-OSS-20B dims, 4 / 2 / 3 / 4 layers; AB_MODEL takes these names too)
#            within ARCHS_BUDGET s (default 270; time one arch leaves, the next gets): bench/agreement.py
#            --configs stock,atom (bf16, CUDA graphs, stock the reference: teacher-forced top-1 and |dlogprob|
#            over ARCHS_PROMPTS prompts (default the largest ARCHS_CONC) of ARCHS_LENGTHS (128/128), the
#            engine logs' kernel lines), then the ab step's cell on that checkpoint (sides stock and atom,
#            AB_CONC=ARCHS_CONC (32), AB_ROUNDS=ARCHS_ROUNDS (2), AB_WINDOW=ARCHS_WINDOW (10)), started when
#            ARCHS_AB_MIN s (150) are left. The agreement engines use the sides' compile caches
#            (/tmp/vcache-stock, -atom) with the cell's engine settings, so the cell's engines start warm.
#            ARCHS_PARTS (agree,ab): one part, e.g. ARCHS_PARTS=ab on the warm machine for a cell that did
#            not fit. -> $OUT/archs/<arch>_agree.{json,txt}, <arch>_agree_{stock,atom}.log.txt,
#            ab_<arch>.{json,txt}, ab_<arch>.logs.txt
#   moeblock bench/moe_block.py (the DeepSeek-V3 MoE block: shared expert fused / always fused / apart;
#            bench/NOTES.md 87-88), MOEBLOCK_ARGS (default --shape dsv3-tp8 --repeat 3), DeepGEMM's JIT cache in
#            /tmp/dg-cache (a cold compile per shape: ~40-120 s) -> $OUT/moe_block_<MOEBLOCK_TAG>.{json,txt}
#   profile  bench/profile_e2e.py on a checkpoint e2e2 built (or a config-only one with PROFILE_ARGS
#            "--load-format dummy"; --conc 1,64: one engine a side for both) -> $OUT/profile/ (kernel time by
#            category, atom vs stock); PROFILE_ARGS (default: the MoE model, 128/128, C=256); PROFILE_TAG=T:
#            $OUT/profile_T/ instead (two profiles in one command, e.g. with and without an ATOM_* variable).
#            After an ab step on a dummy model add "--cache-root /tmp/vcache-{side}" (its warm caches; the routers
#            are drawn as the ab sides draw them) and, for its fp8 atom side, "--side-env atom:ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1"
#   sglang   SGLang 0.5.17 with atom vs stock SGLang (bench/sglang_bench.py; bench/NOTES.md entry 13):
#            unpacks bench/stage_sglang.py's parts from /tmp/sglang-parts into /tmp/site-sglang once,
#            installs this checkout's atom there (entry points visible), imports SGLang's CUDA path
#            (--check: what is missing, then stops), then both engines on the GPU at once, cells
#            interleaved. SGLANG_MODEL (default dense; moe), SGLANG_ARGS (more bench options)
#            -> $OUT/sglang/<model>.json, .txt, <model>/{stock,atom}.log
#   cachepack   the JIT and compile caches a cold start fills (CACHE_DIRS, default: each of
#            /tmp/vcache-*, /tmp/triton-cache, /tmp/torchinductor_$USER, ~/.cache/flashinfer that
#            exists), xz-compressed in 15-MiB parts -> $OUT/cache.tar.xz.partNN; nothing if they
#            exceed CACHE_MAX_MIB (default 45: the parts must travel back with a command's working tree)
#   cacheunpack  the parts in CACHE_FROM (default .stage/cache, a carried folder) back in place: the
#            next machine starts where the packing one stopped (a cache whose key changed, e.g.
#            atom's sides after an atom change, is simply not hit)
# Results land under $OUT, which the device tool brings back.
set -uo pipefail
# /tmp/site-serve (the `serve-deps` step): modules `vllm serve` needs that the staged vLLM lacks,
# after /tmp/site and the machine's own packages in the search order, so they only fill gaps.
export PYTHONPATH=/tmp/site:/tmp/site-serve HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# vLLM builds its top-k/top-p sampler with an unguarded FlashInfer import: off only when FlashInfer is
# not staged (with it staged, stock keeps its own default; greedy decoding never runs that kernel)
[ -d /tmp/site/flashinfer ] || export VLLM_USE_FLASHINFER_SAMPLER=0
# JIT caches under /tmp, which outlives one command while the machine stays warm (DeepGEMM's is
# under each side's VLLM_CACHE_ROOT): `AB_ROUNDS=0 ... ab` fills them, the next call measures
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-cache}"
# multi-GPU hosts: NVLink multicast stays off (the lent machines' rule), also in vLLM's own all-reduce
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"

# ab_profile NAME VAR VALUE... : bench/profile_e2e.py --side atom on FUSION_MODEL once per VALUE of
# the atom variable VAR (dense, 128/128, C=256) -> $OUT/NAME/VALUE.{txt,json}
ab_profile() {
    local name=$1 var=$2; shift 2
    mkdir -p "$OUT/$name"
    for v in "$@"; do
        env "$var=$v" timeout 280 python3 bench/profile_e2e.py --side atom \
            --model "${FUSION_MODEL:-/tmp/atom-e2e-models/dense-L16-v32000}" --in 128 --out 128 --conc 256 \
            --timeout 270 --json "$OUT/$name/$v.json" > "$OUT/$name/$v.txt" 2>&1
        echo "$var=$v"; grep -E "^\| |wall" "$OUT/$name/$v.txt" | head -10
    done
}
# wait_gpu_idle S: up to S seconds until no GPU holds more than 2 GiB (the engines of a run a
# timeout ended may still be shutting down; the next engine sizes its KV cache from what is free)
wait_gpu_idle() {
    local end=$(( $(date +%s) + $1 )) used
    while [ "$(date +%s)" -lt "$end" ]; do
        used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)
        if [ -z "$used" ] || [ "$used" -lt 2048 ]; then return 0; fi
        sleep 2
    done
    echo "GPU still holds $used MiB after $1 s"
}
# has_part NAME: NAME is one of the archs step's ARCHS_PARTS
has_part() { case ",${ARCHS_PARTS:-agree,ab}," in *",$1,"*) return 0 ;; esac; return 1; }
for step in "$@"; do
    echo "=== $step $(date +%T)"
    case "$step" in
        serve-deps) python3 -m pip install -q --no-index --no-deps --target /tmp/site-serve .stage/serve/*.whl 2>&1 | tail -2
              python3 -c "import uvicorn, prometheus_fastapi_instrumentator, vllm.entrypoints.openai.api_server; print('vllm serve imports ok')" 2>&1 | tail -2 ;;
        stagepart) from="${STAGE_FROM:-.stage/fi}"; dir="${STAGE_DIR:-/tmp/stage}"; mkdir -p "$dir"; n=0
              for part in "$from"/*.tar.xz.part*; do [ -f "$part" ] && cp "$part" "$dir/" && n=$((n + 1)); done
              echo "stagepart: $n part(s) from $from; $dir holds $(ls "$dir" | tr '\n' ' ')" ;;
        unstage) dir="${STAGE_DIR:-/tmp/stage}"; site="${STAGE_SITE:-/tmp/site}"
              sums="${STAGE_SUMS:-$(ls "${STAGE_FROM:-.stage/fi}"/*.SHA256SUMS 2>/dev/null | head -1)}"
              [ -n "$sums" ] && [ -f "$sums" ] && sums=$(realpath "$sums")
              if [ -z "$sums" ] || [ ! -f "$sums" ] || ! (cd "$dir" && sha256sum -c --quiet "$sums"); then
                  echo "unstage: staging parts missing or damaged in $dir (sums: ${sums:-none}); $site left as it was"; exit 3; fi
              rm -rf "$site.new" && mkdir -p "$site.new"  # the parts the sums name, in their order
              if ! (cd "$dir" && cat $(awk '{print $2}' "$sums")) | xz -dc | tar -C "$site.new" -xf -; then
                  rm -rf "$site.new"; echo "unstage: unpacking failed; $site left as it was"; exit 3; fi
              rm -rf "$site" && mv "$site.new" "$site" && echo "unstage: $(du -sh "$site" | cut -f1) in $site" ;;
        install) python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .stage/tools/atom_vllm-*.whl 2>&1 | tail -2 ;;
        facts) python3 bench/vllm_facts.py > "$OUT/facts.txt" 2>&1; tail -5 "$OUT/facts.txt" ;;
        demo) timeout 400 python3 scripts/demo.py --out /tmp/demo > "$OUT/demo.txt" 2>&1; tail -8 "$OUT/demo.txt" ;;
        cachepack) root="${CACHE_ROOT:-/}"; root="${root%/}"; dirs=()
              for pat in ${CACHE_DIRS:-/tmp/vcache-* /tmp/triton-cache /tmp/torchinductor_$(whoami) $HOME/.cache/flashinfer}; do
                  for d in "$root"/${pat#/}; do [ -d "$d" ] && dirs+=("${d#"$root"/}"); done; done
              rm -f "$OUT"/cache.tar.xz.part*
              if [ ${#dirs[@]} -eq 0 ]; then echo "cachepack: no cache folder found"; continue; fi
              tar -C "${root:-/}" -cf - "${dirs[@]}" | xz -T0 -6 | split -b 15M -d - "$OUT/cache.tar.xz.part"
              mib=$(( ($(cat "$OUT"/cache.tar.xz.part* | wc -c) + 1048575) / 1048576 ))
              echo "cachepack: ${dirs[*]} -> $mib MiB in $(ls "$OUT"/cache.tar.xz.part* | wc -l) part(s)"
              if [ "$mib" -gt "${CACHE_MAX_MIB:-45}" ]; then
                  rm -f "$OUT"/cache.tar.xz.part*; echo "cachepack: over CACHE_MAX_MIB (${CACHE_MAX_MIB:-45}); nothing kept"; fi ;;
        cacheunpack) from="${CACHE_FROM:-.stage/cache}"
              if ls "$from"/cache.tar.xz.part* > /dev/null 2>&1; then
                  cat "$from"/cache.tar.xz.part* | xz -dc | tar -C "${CACHE_ROOT:-/}" -xf - \
                      && echo "cacheunpack: $(du -sh "$from" | cut -f1) from $from"
              else echo "cacheunpack: no parts in $from"; fi ;;
        tests) # SIGINT at the limit: pytest then still prints the failures so far and its summary
            timeout --signal=INT --kill-after=20 "${GPU_TESTS_TIMEOUT:-540}" python3 -u -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} > "$OUT/gpu_tests.txt" 2>&1; tail -25 "$OUT/gpu_tests.txt" ;;
        moeblock) tag="${MOEBLOCK_TAG:-tp8}"
              DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/dg-cache}" timeout "${MOEBLOCK_TIMEOUT:-540}" python3 -u \
                  bench/moe_block.py ${MOEBLOCK_ARGS:---shape dsv3-tp8 --repeat 3} --json "$OUT/moe_block_$tag.json" \
                  > "$OUT/moe_block_$tag.txt" 2>&1; grep -v "^\s*$" "$OUT/moe_block_$tag.txt" | tail -14 ;;
        ops) timeout 560 python3 bench/ops.py --json-dir "$OUT" > "$OUT/ops.txt" 2>&1; tail -40 "$OUT/ops.txt" ;;
        e2e) mkdir -p "$OUT/e2e"; B=.stage/tools/bench_vllm_baseline.py
             python3 $B build --out /tmp/models > /dev/null 2>&1
             for side in stock atom; do
                 if [ $side = stock ]; then export ATOM_DISABLE_VLLM_PLUGIN=1; else unset ATOM_DISABLE_VLLM_PLUGIN; fi
                 m="${E2E_MODEL:-tiny-qwen3}"
                 timeout 280 python3 $B run --model /tmp/models/$m --json "$OUT/e2e/${m}_$side.json" > "$OUT/e2e/${m}_$side.log" 2>&1
                 grep -E "atom\]|tok/s|ms/token|Error" "$OUT/e2e/${m}_$side.log" | tail -8
             done; unset ATOM_DISABLE_VLLM_PLUGIN ;;
        attn) m="${ATTN_MODES:-PIECEWISE,FULL_AND_PIECEWISE}"; arch="${ATTN_ARCH:-qwen3}"; tag="${arch}_${m//,/_}"
              timeout 590 python3 bench/attention_e2e.py --arch "$arch" --layers "${ATTN_LAYERS:-4}" --modes "$m" --timeout 280 \
                  --model "/tmp/models/attn-$arch-${ATTN_LAYERS:-4}l" --out "$OUT/attn_e2e_$tag.json" \
                  > "$OUT/attn_e2e_$tag.txt" 2>&1; grep "attn-e2e" "$OUT/attn_e2e_$tag.txt" | tail -12 ;;
        e2e2) mkdir -p "$OUT/e2e2"
              timeout 580 python3 bench/e2e.py ${E2E_ARGS:---models dense --lengths 128/128 --concurrency 1,32,256} --cell-seconds "${E2E_CELL_S:-30}" \
                  --budget "${E2E_BUDGET:-520}" --out "$OUT/e2e2/e2e.json" --workdir "$OUT/e2e2/work" \
                  > "$OUT/e2e2/e2e.txt" 2>&1
              grep -E "^\[e2e|^\||^- |elapsed" "$OUT/e2e2/e2e.txt" | tail -60 ;;
        table) m="${TABLE_MODEL:-dense}"; case "$m" in mla) l=4 ;; *) l=16 ;; esac; l="${TABLE_LAYERS:-$l}"
              d="$OUT/table_$m"; mkdir -p "$d"; prof="${TABLE_PROFILE-128/128@256}"
              for c in /tmp/atom-e2e-models/*; do case "$c" in */$m-L$l-*) ;; *) rm -rf "$c" ;; esac; done
              timeout "${TABLE_TIMEOUT:-585}" python3 bench/e2e.py --models "$m" --layers "$m=$l" \
                  --lengths "${TABLE_LENGTHS:-128/128,1024/1024}" --concurrency "${TABLE_CONC:-1,32,256}" \
                  --serve --skip-offline --serve-agreement --serve-max-out-tokens 32768 \
                  --serve-batch ${prof:+--serve-profile "$prof"} ${TABLE_ARGS:-} \
                  --budget "${E2E_BUDGET:-540}" \
                  --out "$d/e2e.json" --workdir "$d/work" > "$d/e2e.txt" 2>&1
              for f in "$d"/work/*/vllm-serve-*.log; do   # flat copies: nested folders do not come back
                  { grep -E "EngineCore.*(ERROR|Error|Traceback)|Worker.*(ERROR|Error)" "$f" | head -150
                    grep -E "ERROR|Error|Traceback|atom\]" "$f" | tail -40; } > "$d/$(basename "$f" .log).errors.txt"
                  # the engine's own step statistics (throughput, running/waiting, KV-cache use, preemptions) and
                  # its start-up stages (weight loading, compile, graph capture)
                  grep -E "throughput|KV cache|[Pp]reempt|concurrency|CUDA graph|init engine|torch.compile|Compil|[Ll]oading|took|Starting vLLM|startup complete" "$f" \
                      | tail -200 > "$d/$(basename "$f" .log).stats.txt"; done
              grep -E "^\[e2e|^\||^- |elapsed|FAILED|Error" "$d/e2e.txt" | tail -70 ;;
        agree) mkdir -p "$OUT/agree"
              timeout 590 python3 bench/agreement.py ${AGREE_ARGS:---model-kind dense} --budget "${AGREE_BUDGET:-500}" \
                  --out "$OUT/agree/agree.json" --workdir /tmp/agree-work > "$OUT/agree/agree.txt" 2>&1
              cp /tmp/agree-work/*.log /tmp/agree-work/*.json "$OUT/agree/" 2>/dev/null; tail -40 "$OUT/agree/agree.txt" ;;
        fusion) ab_profile fusion ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION 0 1 ;;
        elementwise) ab_profile elementwise ATOM_COMPILE_ELEMENTWISE kernels inductor ;;
        fp8gemm) timeout 560 python3 bench/fp8_gemm.py ${FP8GEMM_ARGS:---sweep} --json "$OUT/fp8_gemm.json" \
                > "$OUT/fp8_gemm.txt" 2>&1; tail -60 "$OUT/fp8_gemm.txt" ;;
        ab) m="${AB_MODEL:-dense}"; l="${AB_LAYERS:-4}"; d="/tmp/atom-e2e-models/$m-L$l-v32000"
            skew="${AB_ROUTER_SKEW:-0}"; [ "$skew" != 0 ] && { d="$d-zipf$skew"; m="$m-zipf$skew"; }
            # AB_MLA_EXPERTS (mla, default 64): routed experts per MoE layer (DeepSeek-V3's own: 256), label -e<N>
            [ "$m" = mla ] && [ "${AB_MLA_EXPERTS:-64}" != 64 ] && { d="$d-e$AB_MLA_EXPERTS"; m="$m-e$AB_MLA_EXPERTS"; }
            for w in new old; do
                src=.stage/tools; [ $w = old ] && src=.stage/tools/old
                ls $src/atom_vllm-*.whl >/dev/null 2>&1 && [ ! -d /tmp/atom-$w ] && \
                    python3 -m pip install -q --no-index --no-deps --target /tmp/atom-$w $src/atom_vllm-*.whl 2>&1 | tail -1
            done
            # disk (64 GiB): other models' checkpoints go when under 40 GiB are free
            if [ "$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)" -lt 40 ]; then
                for c in /tmp/atom-e2e-models/*; do case "$c" in "$d"|"$d-fp8") ;; *) rm -rf "$c" ;; esac; done
            fi
            build=""  # build_model keywords. AB_FP8=1: the projections written in 128x128 block fp8 as drawn
            [ "${AB_FP8:-0}" = 1 ] && { d="$d-fp8"; m="$m-fp8"; build=", block_fp8=(128, 128)"; fp8_atom=",ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1"; }
            engine="${AB_ENGINE:-{\}}"  # AB_DUMMY=1: config only, vLLM draws the weights (load_format dummy)
            if [ "${AB_DUMMY:-0}" = 1 ]; then
                d="$d-dummy"; m="$m-dummy"; build="$build, weights=False"
                engine=$(python3 -c "import json, sys; e = json.loads(sys.argv[1]); e['load_format'] = 'dummy'; print(json.dumps(e))" "$engine")
            fi
            python3 -c "import sys; sys.path[:0] = ['bench', '.']; from pathlib import Path; from e2e_models import build_model; \
                print(build_model('${AB_MODEL:-dense}', $l, Path('$d'), 32000, ${AB_MLA_EXPERTS:-64}, 0.02, $skew$build))" 2>&1 | tail -1
            sides=(--side "stock:ATOM_DISABLE_VLLM_PLUGIN=1,PYTHONPATH=/tmp/atom-new:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-stock"
                   --side "atom:PYTHONPATH=/tmp/atom-new:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-atom${fp8_atom:-}")
            [ -d /tmp/atom-old ] && sides+=(--side "old:PYTHONPATH=/tmp/atom-old:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-old")
            # AB_SWITCH_SIDE=NAME:KEY=VALUE,...[;NAME:...]: more sides, the new atom with those variables (each
            # its own compile cache), e.g. cublas:ATOM_BF16_GEMV=0 -- an A/B of one switch next to stock and atom
            IFS=';' read -r -a switch_sides <<< "${AB_SWITCH_SIDE:-}"
            for sw in "${switch_sides[@]}"; do [ -n "$sw" ] && \
                sides+=(--side "${sw%%:*}:PYTHONPATH=/tmp/atom-new:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-${sw%%:*}${fp8_atom:-},${sw#*:}"); done
            if [ -n "${AB_SIDES:-}" ]; then  # only these sides (e.g. a cold fill of one side per call)
                keep=(); for ((i = 1; i < ${#sides[@]}; i += 2)); do
                    case ",$AB_SIDES," in *",${sides[i]%%:*},"*) keep+=(--side "${sides[i]}") ;; esac; done
                sides=("${keep[@]}")
            fi
            arrivals="${AB_ARRIVALS:-batch}"; m_label="$m"; [ "$arrivals" = continuous ] && m="$m-cont"
            rm -rf "/tmp/ab-logs-$m"  # this command's launches only
            timeout "${AB_TIMEOUT:-560}" python3 bench/ab.py --model "$d" --label "$m_label-L$l" "${sides[@]}" \
                --arrivals "$arrivals" \
                --in "${AB_IN:-128}" --out "${AB_OUT:-128}" --conc "${AB_CONC:-32}" --rounds "${AB_ROUNDS:-5}" --launches "${AB_LAUNCHES:-1}" --first-shift "${AB_FIRST_SHIFT:-0}" \
                --window "${AB_WINDOW:-15}" --warmup "${AB_WARMUP:-5}" --gpu-util "${AB_GPU_UTIL:-0.28}" --logdir "/tmp/ab-logs-$m" \
                $([ "${AB_FRESH_COMPILE:-0}" = 1 ] && echo --fresh-compile) $([ "${AB_FILL_PARALLEL:-0}" = 1 ] && echo --overlap-starts) \
                --engine "$engine" \
                --json "$OUT/ab_$m.json" > "$OUT/ab_$m.txt" 2>&1
            # each side's and launch's errors, kernel choices and start-up stages, in one file (the device
            # returns at most 8 files per call: a cell's JSON each, the text, and this)
            for f in /tmp/ab-logs-$m/*.log; do echo "=== $(basename "$f")"
                grep -E "ERROR|Error|Traceback|atom\]|Selected|[Uu]sing|warmup|Model loading|took|Compil|CUDA graph|KV cache size" "$f" \
                    | tail -150; done > "$OUT/ab_$m.logs.txt"
            tail -12 "$OUT/ab_$m.txt" ;;
        archs) mkdir -p "$OUT/archs"; t_archs=$(date +%s); n=0
            conc="${ARCHS_CONC:-32}"; lens="${ARCHS_LENGTHS:-128/128}"; archs="${ARCHS:-llama,mixtral}"
            # max_logprobs as agreement.py's engines have it: the same compile-cache key (the cell asks no logprobs)
            ab_engine='{"max_logprobs": 2}'
            # as many prompts as the cell's engines take sequences, and its lengths: the same compile-cache key
            prompts="${ARCHS_PROMPTS:-$(tr , '\n' <<< "$conc" | sort -n | tail -1)}"
            ls .stage/tools/atom_vllm-*.whl >/dev/null 2>&1 && [ ! -d /tmp/atom-new ] && \
                python3 -m pip install -q --no-index --no-deps --target /tmp/atom-new .stage/tools/atom_vllm-*.whl 2>&1 | tail -1
            for a in ${archs//,/ }; do
                n=$((n + 1)); end=$((t_archs + n * ${ARCHS_BUDGET:-270}))
                [ $((end - $(date +%s))) -gt 60 ] || { echo "$a: skipped, under 60 s left of its budget"; continue; }
                l=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from e2e_models import MODELS; print(MODELS['$a'][2])") \
                    || { echo "$a: not a bench/e2e_models.py model"; continue; }
                d="/tmp/atom-e2e-models/$a-L$l-v32000"; w="/tmp/archs-agree-$a"
                echo "--- $a ($l layers) $(date +%T), until $(date -d "@$end" +%T)"
                # disk (64 GiB): the other models' checkpoints go when under 40 GiB are free
                if [ "$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)" -lt 40 ]; then
                    for c in /tmp/atom-e2e-models/*; do [ "$c" = "$d" ] || rm -rf "$c"; done
                fi
                timeout $((end - $(date +%s))) python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
                    from e2e_models import build_model; print(build_model('$a', $l, Path('$d'), 32000, 64, 0.02))" 2>&1 | tail -1
                half=$(( (end - $(date +%s) - 10) / 2 ))
                if has_part agree && [ "$half" -lt 45 ]; then
                    echo "$a: agreement not started ($half s per engine left)"
                elif has_part agree; then
                    # each engine at most half of what is left; atom's starts only if stock's ended within its half
                    rm -rf "$w"
                    PYTHONPATH=/tmp/atom-new:/tmp/site timeout $((2 * half + 5)) python3 bench/agreement.py --model "$d" \
                        --configs stock,atom --prompts "$prompts" --lengths "$lens" --timeout "$half" --budget "$half" \
                        --cache-root '/tmp/vcache-{side}' --workdir "$w" --out "$OUT/archs/${a}_agree.json" \
                        > "$OUT/archs/${a}_agree.txt" 2>&1
                    for s in stock atom; do  # kernel / backend choices and errors (flat copies)
                        grep -E "Selected|Using|atom\]|ERROR|Error|Traceback" "$w/$s.log" 2>/dev/null | tail -150 \
                            > "$OUT/archs/${a}_agree_$s.log.txt"; done
                    grep -E "^\[agree|^reference|^\| (config|atom) " "$OUT/archs/${a}_agree.txt" | cut -c1-400 | tail -8
                    wait_gpu_idle 90
                fi
                left=$((end - $(date +%s)))
                if has_part ab && [ "$left" -lt "${ARCHS_AB_MIN:-150}" ]; then
                    echo "$a: ab cell not started ($left s left of its budget): ARCHS=$a ARCHS_PARTS=ab on this machine"
                elif has_part ab; then
                    OUT="$OUT/archs" AB_MODEL="$a" AB_LAYERS="$l" AB_CONC="$conc" AB_IN="${lens%/*}" AB_OUT="${lens#*/}" \
                        AB_ROUNDS="${ARCHS_ROUNDS:-2}" AB_WINDOW="${ARCHS_WINDOW:-10}" AB_LAUNCHES=1 AB_FP8=0 AB_ROUTER_SKEW=0 \
                        AB_SIDES="${ARCHS_SIDES:-stock,atom}" AB_ENGINE="${ARCHS_AB_ENGINE:-$ab_engine}" \
                        AB_TIMEOUT=$((left - 15)) bash "${BASH_SOURCE[0]}" ab
                    wait_gpu_idle 90
                fi
            done ;;
        profile) pdir="$OUT/profile${PROFILE_TAG:+_$PROFILE_TAG}"; mkdir -p "$pdir"
              timeout "${PROFILE_TIMEOUT:-580}" python3 bench/profile_e2e.py ${PROFILE_ARGS:---model /tmp/atom-e2e-models/moe-L4-v32000 --in 128 --out 128 --conc 256} \
                  --json "$pdir/profile.json" > "$pdir/profile.txt" 2>&1
              tail -60 "$pdir/profile.txt" ;;
        sglang) mkdir -p "$OUT/sglang" /tmp/site-sglang; m="${SGLANG_MODEL:-dense}"
              if [ ! -d /tmp/site-sglang/sglang ]; then
                  (cd /tmp/sglang-parts && sha256sum -c sglang0517.SHA256SUMS) || { echo "parts missing or corrupt"; continue; }
                  cat /tmp/sglang-parts/sglang0517.tar.xz.part* | xz -d -T0 | tar -x -C /tmp/site-sglang
              fi
              # SGLang's own site only (vLLM's carried packages differ in version); atom from this checkout
              PYTHONPATH=/tmp/site-sglang python3 -m pip install -q --no-index --no-deps --no-build-isolation \
                  --upgrade --target /tmp/site-sglang . 2>&1 | grep -v WARNING | tail -2
              if ! PYTHONPATH=/tmp/site-sglang python3 bench/sglang_bench.py --check > "$OUT/sglang/check.txt" 2>&1; then
                  grep -E "MISSING|entry" "$OUT/sglang/check.txt"; continue
              fi
              PYTHONPATH=/tmp/site-sglang timeout 570 python3 bench/sglang_bench.py --models "$m" --budget 450 \
                  --out "$OUT/sglang/$m.json" --workdir "$OUT/sglang" ${SGLANG_ARGS:-} > "$OUT/sglang/$m.txt" 2>&1
              grep -E "^\||elapsed|Error|error" "$OUT/sglang/$m.txt" | tail -30 ;;
        *) echo "unknown step $step" ;;
    esac
done

#!/usr/bin/env python
"""One side of ``bench/ab.py``: an offline vLLM engine that measures on command.

    python bench/ab_worker.py SPEC_JSON        (started by bench/ab.py, one process per side)

Builds ``vllm.LLM`` from the spec, prints ``READY {facts}``, then reads one JSON command per line
on stdin: ``{"seed": S, "seconds": W[, "conc": C]}`` runs batches of ``conc`` fresh random prompts (seeded
``S``, ``S+1``, ...) of ``in_len`` tokens x ``out_len`` new tokens, greedy, ``ignore_eos``, until
``W`` seconds have passed, and prints ``RESULT {...}``: output tokens, seconds, tok/s, batches,
and the first 32 tokens of the first 8 prompts of the first batch (for agreement across sides).

With ``"arrivals": "continuous"`` in the spec a window keeps ``conc`` requests in flight instead
(:func:`continuous_window`): a finished request is replaced at once, so new prompts arrive while
others decode and most steps mix a prefill into the decode batch, as in online serving (batches of
``conc`` submitted together instead finish together: their steps are nearly all pure decode).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import time

#: A MoE block's router, by module name: ``mlp.gate`` (Qwen3-MoE, DeepSeek-V3, GLM-4-MoE),
#: ``block_sparse_moe.gate`` (Mixtral), ``mlp.router`` (GPT-OSS).
ROUTER_NAME = re.compile(r"(^|\.)(mlp|block_sparse_moe)\.(gate|router)$")


def versions() -> dict:
    """The packages this side ran (atom: the version and where it was imported from; flashinfer and
    deep_gemm: absent when not staged, which changes the kernels stock vLLM may select)."""
    import importlib

    def first_importable(*names):
        for mod_name in names:
            try:
                return importlib.import_module(mod_name)
            except Exception:  # not staged, or staged without what it needs to import
                pass
        return None

    out = {}
    for name in ("vllm", "torch", "triton", "atom", "flashinfer", "deep_gemm"):
        # vLLM prefers a separately installed deep_gemm and falls back to the copy in its wheel
        mod = first_importable(name, *(["vllm.third_party.deep_gemm"] if name == "deep_gemm" else []))
        if mod is None:
            out[name] = None
            continue
        out[name] = getattr(mod, "__version__", "?")
        if name == "atom":
            out["atom_from"] = os.path.dirname(os.path.dirname(mod.__file__ or ""))
    return out


def continuous_window(engine, spec: dict, conc: int, seed: int, seconds: float, vocab: int,
                      detokenize: bool = True) -> dict:
    """``seconds`` of load with ``conc`` requests always in flight, on vLLM's ``LLMEngine``.

    A first wave of ``conc`` requests with lengths spread over 1..``out_len`` new tokens starts the
    window (unmeasured), so that afterwards about ``conc / out_len`` requests finish per step and as
    many new ones (``out_len`` new tokens each) take their places: every step then carries a few
    prefills next to the running decodes. The window is timed from the step where the last
    first-wave request finished; tokens are counted per step (``RequestOutputKind.DELTA``). At the
    end the requests still running are aborted. ``mixed_steps``: measured steps that followed an
    arrival (their batch held a new prompt). ``detokenize=False``: no text (an engine in this
    process, as bench/profile_e2e.py runs it, would otherwise detokenize on its host timeline)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    rng = random.Random(seed)
    out_len = int(spec["out_len"])
    live: dict[str, int] = {}  # our request id -> its index k (the order it was added in)
    first: dict[int, list[int]] = {}
    added = 0

    def add(max_tokens: int) -> None:
        nonlocal added
        prompt = {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(spec["in_len"])]}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA, detokenize=detokenize)
        request_id = f"ab{seed}_{added}"
        engine.add_request(request_id, prompt, params)  # returns vLLM's internal id (ours + a suffix)
        live[request_id] = added  # outputs carry ours, and abort_request takes ours
        added += 1

    for i in range(conc):
        add(1 + (i * out_len) // conc)
    wave = conc  # first-wave requests still running
    tokens = steps = mixed = requests = 0
    t0 = None
    arrived = 0
    while True:
        outs = engine.step()
        now = time.perf_counter()
        if t0 is not None:
            steps += 1
            mixed += arrived > 0
        arrived = 0
        for o in outs:  # per step and running request: keep this loop light
            new = o.outputs[0].token_ids if o.outputs else ()
            k = live[o.request_id]
            if k < 8:
                first.setdefault(k, []).extend(new)
            if t0 is not None:
                tokens += len(new)
            if o.finished:
                del live[o.request_id]
                if t0 is not None:
                    requests += 1
                if k < conc:
                    wave -= 1
                if t0 is None or now - t0 < seconds:
                    add(out_len)
                    arrived += 1
        if t0 is None and wave == 0:
            t0 = now  # the ramp is over: measure from here
        elif t0 is not None and now - t0 >= seconds and steps > 0:
            elapsed = now - t0
            break
    aborted = len(live)
    if live:
        engine.abort_request(sorted(live))
    while engine.has_unfinished_requests():
        engine.step()
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "steps": steps, "mixed_steps": mixed,
            "requests": requests, "aborted": aborted, "first": [first.get(k, [])[:32] for k in range(min(8, conc))]}


def distinct_per_step(token_ids: list) -> list[int]:
    """For each output position, how many different tokens the batch's sequences emitted there. A MoE
    decode step routes the batch's tokens; when most sequences emit the same token (a model whose greedy
    outputs fall into one cycle, as vLLM's dummy weights can make them), the step's tokens go to few
    experts, and the cell times hot experts rather than weight streaming: this says which."""
    length = max((len(t) for t in token_ids), default=0)
    return [len({t[j] for t in token_ids if len(t) > j}) for j in range(length)]


#: The floating dtypes a router may hold its weights in and still be the checkpoint's router (a
#: bf16 checkpoint's values are exact in float32); anything else (fp8, int) is a quantised router.
ROUTER_FLOAT_DTYPES = ("bfloat16", "float16", "float32")

#: The standard deviation of the router weights :func:`draw_routers` draws: the checkpoint
#: builder's ``init_std`` (bench/e2e_models.py), so that the logits spread as a built checkpoint's do.
ROUTER_STD = 0.02


def _routers(model) -> list[tuple[str, object]]:
    return [(name, m) for name, m in model.named_modules()
            if ROUTER_NAME.search(name) and getattr(getattr(m, "weight", None), "dtype", None) is not None]


def _layer(name: str, default: int) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else default


def router_facts(model) -> dict | None:
    """What the MoE routers of a loaded model hold (``None`` for a model without any): how many,
    their weights' dtypes, their vLLM quantisation methods (where they have one), whether they are
    quantised, and a checksum of their values (each parameter's float64 sum, those added exactly:
    deterministic, so two sides' checksums agree when their routers hold the same values in whatever
    float width, and a changed value moves them). A side whose routers are quantised while the other's are not
    serves another model: stock vLLM's Qwen3-MoE router takes the checkpoint's fp8 config unless the
    checkpoint lists it as unquantised (bench/NOTES.md entry 68), which is how every Qwen3-MoE fp8
    cell before 2026-12-01 compared atom with a stock whose routing was broken. So does a side whose
    routers hold other values: vLLM's dummy loader draws each parameter in its own dtype, so atom's
    float32 router and stock's bf16 one differ unless :func:`draw_routers` redraws both."""
    import math

    routers = _routers(model)
    if not routers:
        return None
    methods = {type(m.quant_method).__name__ for _, m in routers if getattr(m, "quant_method", None) is not None}
    dtypes = sorted({str(m.weight.dtype).removeprefix("torch.") for _, m in routers})
    sums = [float(p.detach().double().sum().cpu()) for _, m in routers for p in m.parameters(recurse=False)
            if p.is_floating_point()]
    # vLLM-CPU moves a router's weight into a packed ``cpu_linear`` and leaves an empty parameter:
    # its values cannot be read, so no checksum
    held = all(m.weight.numel() > 0 for _, m in routers)
    return {"count": len(routers), "dtypes": dtypes, "quant_methods": sorted(methods),
            "quantised": any(d not in ROUTER_FLOAT_DTYPES for d in dtypes)
            or any(q != "UnquantizedLinearMethod" for q in methods),
            "checksum": f"{math.fsum(sums):.12e}" if held else None}


def draw_routers(model, seed: int = 0) -> int:
    """Give every unquantised MoE router the same values on every side of a dummy-weight cell; returns
    how many it drew. vLLM's dummy loader draws each parameter uniform in +-1e-3 from one seed, so
    every layer's router holds the same values, and a DeepSeek-V3-style correction bias (+-1e-3)
    outweighs the router logits (~1e-5): every token goes to the same 8 of 256 experts (bench/NOTES.md
    entry 75). Each router's weight becomes normal with :data:`ROUTER_STD`, seeded by its layer and
    rounded to bf16 (so a float32 router holds exactly a bf16 one's values), and its other parameters
    (the correction bias, a linear bias) zero: routing by the logits, about uniform over the experts.
    Written in place, so CUDA graphs captured before see the new values."""
    import torch

    drawn = 0
    for i, (name, m) in enumerate(_routers(model)):
        if str(m.weight.dtype).removeprefix("torch.") not in ROUTER_FLOAT_DTYPES or m.weight.numel() == 0:
            continue  # quantised, or packed elsewhere (vLLM-CPU): router_facts says so
        gen = torch.Generator().manual_seed(seed * 100_003 + _layer(name, i))
        values = (torch.randn(tuple(m.weight.shape), generator=gen) * ROUTER_STD).to(torch.bfloat16)
        with torch.no_grad():
            m.weight.copy_(values.to(m.weight.device))
            for pname, p in m.named_parameters(recurse=False):
                if pname != "weight" and p.is_floating_point():
                    p.zero_()
        drawn += 1
    return drawn


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    # apply_model ships a function to vLLM's engine process (its default multi-process engine):
    # msgspec refuses that unless pickle is allowed.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], gpu_memory_utilization=spec["gpu_util"], max_model_len=spec["max_model_len"],
              max_num_seqs=max(spec["conc"], 1), seed=0, **spec.get("engine", {}))

    def facts(model):  # what ran: model class, attention impls, the MoE routers' weights
        impls = sorted({type(m.impl).__name__ for _, m in model.named_modules() if hasattr(m, "impl")})
        return {"model_class": f"{type(model).__module__}.{type(model).__qualname__}", "attention_impls": impls,
                **({"routers": routers} if (routers := router_facts(model)) else {})}

    drawn = llm.apply_model(draw_routers)[0] if spec.get("draw_routers") else None  # dummy weights
    ran = llm.apply_model(facts)[0]
    if drawn is not None and "routers" in ran:
        ran["routers"]["drawn"] = drawn
    ran["versions"] = versions()
    print("READY " + json.dumps(ran), flush=True)
    vocab = int(spec["vocab"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["out_len"], ignore_eos=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        seed, deadline = int(cmd["seed"]), float(cmd["seconds"])
        conc = int(cmd.get("conc", spec["conc"]))  # at most the engine's max_num_seqs
        if spec.get("arrivals") == "continuous":
            res = continuous_window(llm.llm_engine, spec, conc, seed, deadline, vocab)
            print("RESULT " + json.dumps(res), flush=True)
            continue
        tokens, elapsed, batches, first = 0, 0.0, 0, None
        while elapsed < deadline or batches == 0:
            rng = random.Random(seed + batches)
            prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(spec["in_len"])]}
                       for _ in range(conc)]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed += time.perf_counter() - start
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            if first is None:
                first = [list(o.outputs[0].token_ids[:32]) for o in outs[:8]]
                distinct = distinct_per_step([o.outputs[0].token_ids for o in outs])
            batches += 1
        print("RESULT " + json.dumps({"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
                                      "batches": batches, "first": first,
                                      "distinct_tokens_median": statistics.median(distinct) if distinct else None,
                                      "distinct_tokens_min": min(distinct) if distinct else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One process, one side (atom on or off, from the environment): every non-generate runner vLLM
offers for atom's architectures, on tiny checkpoints, reduced to JSON (tests/plugin/test_runners.py).

    python -m tests.plugin._runner_child MODELS_DIR OUT.json
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from pathlib import Path

PROMPTS = ["hello world", "a b c d e f g h i j k l m n o p q r s t u v w x y z and more words to fill a block"]
ENGINE = dict(dtype="float32", max_model_len=128, gpu_memory_utilization=0.3, seed=0, enforce_eager=True)


def build(models: Path) -> dict[str, Path]:
    """The tiny checkpoints: Qwen3 and Llama as built by atom.testing, and variants whose
    ``architectures`` name a pooling class (``Qwen3Model``) or a classifier with its head."""
    import torch
    import transformers

    from atom.testing.tiny_models import build as build_tiny

    paths = {kind: build_tiny(kind, models / kind, dtype="float32") for kind in ("qwen3", "llama")}

    def variant(src: Path, name: str, arch: str, **config) -> Path:
        dst = models / name
        if not (dst / "config.json").exists():
            cfg = transformers.AutoConfig.from_pretrained(src)
            cfg.architectures = [arch]
            for k, v in config.items():
                setattr(cfg, k, v)
            torch.manual_seed(0)
            model_cls = getattr(transformers, arch, None) or transformers.AutoModel
            model = (model_cls(cfg) if model_cls is not transformers.AutoModel else model_cls.from_config(cfg))
            model.to(torch.float32).save_pretrained(dst)
            for f in src.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
                    shutil.copy(f, dst)
        return dst

    paths["qwen3_model"] = variant(paths["qwen3"], "qwen3_model", "Qwen3Model")
    paths["qwen3_cls"] = variant(paths["qwen3"], "qwen3_cls", "Qwen3ForSequenceClassification", num_labels=3)
    paths["qwen3_ce"] = variant(paths["qwen3"], "qwen3_ce", "Qwen3ForSequenceClassification", num_labels=1)
    return paths


def main(argv: list[str]) -> int:
    models, out = Path(argv[0]), Path(argv[1])
    paths = build(models)
    from vllm import LLM

    cases = [  # name, checkpoint, engine kwargs, call
        ("embed_qwen3", "qwen3", dict(runner="pooling"), "embed"),
        ("embed_llama", "llama", dict(runner="pooling"), "embed"),
        ("embed_convert", "qwen3", dict(runner="pooling", convert="embed"), "embed"),
        ("embed_qwen3_model_arch", "qwen3_model", {}, "embed"),
        ("classify", "qwen3_cls", {}, "classify"),
        ("score", "qwen3_ce", {}, "score"),
        ("generate", "qwen3", {}, "generate"),
    ]
    result = {}
    for name, kind, kwargs, call in cases:
        llm = LLM(model=str(paths[kind]), **ENGINE, **kwargs)
        info = llm.apply_model(lambda m: {
            "classes": [k.__module__ + "." + k.__qualname__ for k in type(m).__mro__[:3]],
            "impls": sorted({type(x.impl).__name__ for _, x in m.named_modules() if hasattr(x, "impl")}),
        })[0]
        if call == "embed":
            values = [list(r.outputs.embedding) for r in llm.embed(PROMPTS)]
        elif call == "classify":
            values = [list(r.outputs.probs) for r in llm.classify(PROMPTS)]
        elif call == "score":
            values = [[r.outputs.score] for r in llm.score(PROMPTS[0], PROMPTS)]
        else:
            from vllm import SamplingParams

            outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            values = [list(o.outputs[0].token_ids) for o in outs]
        result[name] = {**info, "values": values}
        del llm
        gc.collect()
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main(sys.argv[1:]))

"""atom's attention layers, host-neutral: paged MHA/GQA (:mod:`.mha`) and multi-head latent
attention (:mod:`.mla`), each as a backend declaration, a metadata builder and an impl over
atom's ops, plus the step batch they are built from (:mod:`.common`).

Nothing here imports a host framework. A host binds these classes to its own attention
interface: vLLM through the decorators of ``atom.plugin.vllm.attention_mha`` /
``attention_mla`` (registered records that inject what vLLM calls), SGLang through
``atom.plugin.sglang`` (planned).
"""

"""The models: one decoder block shared by the target and the drafter.

* ``config`` -- :class:`ModelConfig` and the shared parsing of Hugging Face ``config.json`` files;
* ``layers`` -- RMSNorm, RoPE, attention and MLP, the :class:`DecoderBlock`;
* ``kv_cache`` -- fixed-shape KV caches written in place;
* ``target`` -- the Qwen3 / Qwen2 / Llama target with stacked layers;
* ``drafter`` -- the DFlash drafter (:class:`DrafterConfig`, :class:`DFlashDrafter`, :func:`init_drafter`);
* ``retrace`` -- ReTrace's rejected-suffix memory and its gated fusion;
* ``draft_vocab`` -- a drafter that proposes from a subset of the vocabulary;
* ``tiny`` -- tiny random targets for demos and tests.
"""

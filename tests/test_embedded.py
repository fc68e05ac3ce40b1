"""The shipped embedded family on the CPU: its EAGLE-3 head's acceptance, plausible Python, and
speculation that changes no token."""

from __future__ import annotations

from specserve import LLM, SamplingParams


def test_embedded_eagle3_acceptance_and_python() -> None:
    from specserve.data import embedded_model_dir, load_prompts
    from specserve.train.family import fraction_parsing

    target, spec = embedded_model_dir()
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    prompts = [r["prompt"] for r in load_prompts("code", 16)]
    # The head's quality at K = 3: every step drafts three (no adaptive budget, whose choices
    # follow step timings).
    llm = LLM(target, speculative_config={**spec, "adaptive": False})
    frac = fraction_parsing(llm.engine, prompts, max_tokens=96)
    m = llm.get_metrics()
    print(
        f"embedded EAGLE-3, K = 3, {len(prompts)} held-out prompts: acceptance length "
        f"{m['spec_decode_mean_acceptance_length']:.2f}, {frac:.0%} of completions parse"
    )
    assert m["spec_decode_mean_acceptance_length"] >= 2.2
    assert frac >= 0.5
    # Lossless: the same greedy tokens as the target alone.
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM(target).generate(prompts[:4], sp, use_tqdm=False)
    spec_out = llm.generate(prompts[:4], sp, use_tqdm=False)
    for a, b in zip(plain, spec_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids

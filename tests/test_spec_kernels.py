"""Hot-path Triton kernels (ops/spec_kernels*.py) against their torch references.

Each check runs twice: on CPU tensors under the Triton interpreter (`-m interpret`, with
TRITON_INTERPRET=1) and on CUDA tensors (`-m gpu`), where the public functions dispatch to the
kernels. Inputs are random: mixed prefill / verify batches, padded rows on the scratch row with
slot -1, positions up to and past max_model_len, several KV block sizes. Verification must give
bit-identical tokens and accept counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from specserve.ops import spec_kernels as sk
from specserve.sample.rejection import rejection_sample_kernel, rejection_sample_ref
from specserve.sample.sampler import SamplingTensors

from .test_triton_attention import _no_interpreter, interpreter, needs_cuda  # noqa: F401

# The interpreter variant of every check (CPU tensors) and the CUDA one.
DEVICES = [
    pytest.param("cpu", marks=[pytest.mark.interpret, _no_interpreter], id="interpret"),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda], id="cuda"),
]
K = 3
NUM_ROWS = 9  # persistent rows; the last is the scratch row


def _kernels(device: str) -> object:
    """The Triton wrappers: called directly on CPU (interpreter), through dispatch on CUDA."""
    if device == "cuda":
        return sk
    pytest.importorskip("triton")
    from specserve.ops import spec_kernels_triton as skt

    class Direct:
        prepare_target_inputs = staticmethod(skt.prepare_target_inputs_triton)
        write_verified_tokens_ = staticmethod(skt.write_verified_tokens_triton_)
        prepare_draft_prefill_inputs = staticmethod(skt.prepare_draft_prefill_inputs_triton)
        prepare_draft_decode_inputs = staticmethod(skt.prepare_draft_decode_inputs_triton)
        advance_decode_metadata_ = staticmethod(skt.advance_decode_metadata_triton_)
        place_on_device_ = staticmethod(skt.place_on_device_triton_)

    return Direct


def _state(
    g: torch.Generator, max_model_len: int, block_size: int, device: str
) -> tuple[Tensor, Tensor]:
    """Random persistent token buffer [rows, max_model_len + K + 2] and block table of shuffled
    pages [rows, max_blocks] int32 (the scratch row holds the null block only)."""
    width = max_model_len + K + 2
    max_blocks = -(-max_model_len // block_size)
    token_ids = torch.randint(0, 1000, (NUM_ROWS, width), generator=g)
    pages = torch.randperm(NUM_ROWS * max_blocks, generator=g).view(NUM_ROWS, max_blocks)
    pages[-1] = NUM_ROWS * max_blocks  # the null block
    return token_ids.to(device), pages.to(torch.int32).to(device)


def _step(g: torch.Generator, max_model_len: int, device: str, shift: int = 1) -> dict[str, Tensor]:
    """A mixed batch: prefill chunks and 1 + K verify slots with random accept counts, in
    shuffled rows, plus one padded request on the scratch row."""
    B = 6
    rows = torch.randperm(NUM_ROWS - 1, generator=g)[: B - 1]
    rows = torch.cat([rows, torch.tensor([NUM_ROWS - 1])])
    num_sched = torch.randint(1, 40, (B,), generator=g)
    num_sched[1:4] = K + 1  # verify requests
    num_sched[0] = min(300, max_model_len - shift)  # spans programs of the per-token kernels
    num_draft = torch.zeros(B, dtype=torch.int64)
    num_draft[1:4] = torch.randint(0, K + 1, (3,), generator=g)
    num_acc = (torch.rand(B, generator=g) * (num_draft + 1)).long()
    # Sequences end anywhere up to max_model_len (minus the shifted read past the last token).
    ends = torch.randint(0, max_model_len - shift + 1, (B,), generator=g)
    ends = torch.maximum(ends, num_sched)
    ends[2] = max_model_len - shift  # at the very end
    assert int(ends.max()) <= max_model_len - shift
    starts = ends - num_sched
    qsl = torch.zeros(B + 1, dtype=torch.int64)
    qsl[1:] = num_sched.cumsum(0)
    T = int(qsl[-1])
    token_req = torch.repeat_interleave(torch.arange(B), num_sched)
    positions = starts[token_req] + torch.arange(T) - qsl[token_req]
    step = dict(
        idx_mapping=rows,
        token_req=token_req,
        positions=positions,
        query_start_loc=qsl,
        num_draft=num_draft,
        num_acc=num_acc,
        out_pos0=ends - num_draft,
        seq_lens=ends,
        samples=(torch.arange(B) % 4 != 0).long(),  # rows 0 and 4: mid-prompt chunks
    )
    return {name: t.to(device) for name, t in step.items()}


def _assert_equal(a: Tensor, b: Tensor, name: str) -> None:
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    assert torch.equal(a, b), name


# ---- target inputs ----------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prepare_target_inputs(device: str, block_size: int) -> None:
    ops = _kernels(device)
    g = torch.Generator().manual_seed(block_size)
    max_model_len = 1100 if block_size == 1 else 400  # 1100 blocks: two column tiles
    token_ids, bt = _state(g, max_model_len, block_size, device)
    s = _step(g, max_model_len, device)
    args = (token_ids, bt, s["idx_mapping"], s["token_req"], s["positions"], block_size)
    for name, a, b in zip(
        ("input_ids", "slot_mapping", "block_table"),
        ops.prepare_target_inputs(*args),
        sk.prepare_target_inputs_ref(*args),
    ):
        _assert_equal(a, b, name)
    # Into given buffers (a CUDA graph's inputs: views of larger tensors).
    T, B = s["positions"].shape[0], s["idx_mapping"].shape[0]
    i64 = {"dtype": torch.int64, "device": device}
    views = (torch.zeros(T + 5, **i64)[:T], torch.zeros(T + 5, **i64)[:T])
    views += (torch.zeros(B + 2, bt.shape[1], dtype=torch.int32, device=device)[:B],)
    got = ops.prepare_target_inputs(*args, views)
    for a, b, v in zip(got, sk.prepare_target_inputs_ref(*args), views):
        _assert_equal(v, b, "out=")
        assert a.data_ptr() == v.data_ptr()
    # ... and positions / seq_lens into a graph's metadata buffers (seq_lens to int32).
    meta = (torch.zeros(T + 5, **i64)[:T], torch.zeros(B + 2, dtype=torch.int32, device=device)[:B])
    ops.prepare_target_inputs(*args, views, (s["seq_lens"], *meta))
    _assert_equal(meta[0], s["positions"], "meta positions")
    _assert_equal(meta[1], s["seq_lens"].to(torch.int32), "meta seq_lens")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drafted", [True, False])
def test_write_verified_tokens(device: str, drafted: bool) -> None:
    """Tokens written, and num_computed = seq_lens - num_draft + accepted for the step's rows
    (untouched elsewhere); not drafted: no accept counts passed, one token a row."""
    ops = _kernels(device)
    g = torch.Generator().manual_seed(3)
    token_ids, _ = _state(g, 400, 16, device)
    s = _step(g, 400, device)
    B = s["idx_mapping"].shape[0]
    num_acc = s["num_acc"] if drafted else None
    k1 = K + 1 if drafted else 1
    out = torch.randint(0, 1000, (B, k1), generator=g).to(device)
    if drafted:
        j = torch.arange(K + 1, device=device)
        out = torch.where(j[None, :] <= s["num_acc"][:, None], out, -1)
    seq_lens = s["out_pos0"] + s["num_draft"]
    computed = torch.full((NUM_ROWS,), -7, dtype=torch.int64, device=device)
    ref_computed = computed.clone()
    args = (s["idx_mapping"], s["out_pos0"], out, num_acc, s["samples"])
    ref = token_ids.clone()
    sk.write_verified_tokens_ref_(ref, *args, ref_computed, seq_lens, s["num_draft"])
    ops.write_verified_tokens_(token_ids, *args, computed, seq_lens, s["num_draft"])
    # The scratch (last) column takes masked-off writes in the reference only.
    _assert_equal(token_ids[:, :-1], ref[:, :-1], "token_ids")
    _assert_equal(computed, ref_computed, "num_computed")
    acc = s["num_acc"] if drafted else 0
    expect = seq_lens - s["num_draft"] + acc
    assert torch.equal(computed[s["idx_mapping"]], expect)
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool, device=device)
    untouched[s["idx_mapping"]] = False
    assert bool((computed[untouched] == -7).all())


@pytest.mark.parametrize("device", DEVICES)
def test_place_on_device(request, device: str) -> None:
    """Async scheduling's device-side start correction, in place: rows flagged shift their
    positions (all of their tokens, one request spanning several kernel blocks), seq_lens and
    out_pos0 by num_computed - (out_pos0 - 1); other rows stay."""
    ops = _kernels(device)
    if device == "cpu":
        request.getfixturevalue("interpreter")  # the kernel's token loop has tensor bounds
    g = torch.Generator().manual_seed(5)
    s = _step(g, 400, device)
    B = s["idx_mapping"].shape[0]
    on = torch.tensor([1, 0, 1, 1, 0, 1], device=device)
    num_computed = torch.randint(0, 300, (NUM_ROWS,), generator=g).to(device)
    seq_lens = s["out_pos0"] + 1
    a = [s["positions"].clone(), seq_lens.clone(), s["out_pos0"].clone()]
    b = [t.clone() for t in a]
    meta = (num_computed, s["idx_mapping"], on, s["query_start_loc"])
    ops.place_on_device_(*meta, *a)
    sk.place_on_device_ref_(*meta, *b)
    for name, x, y in zip(("positions", "seq_lens", "out_pos0"), a, b):
        _assert_equal(x, y, name)
    assert B == 6 and not torch.equal(a[0], s["positions"])  # something moved
    # Unflagged rows are untouched; flagged ones start where num_computed says.
    assert torch.equal(a[2][1], s["out_pos0"][1])
    assert torch.equal(a[2][0] - 1, num_computed[s["idx_mapping"][0]])


# ---- draft prefill / decode inputs ------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("qsl_dtype", [torch.int64, torch.int32])
def test_prepare_draft_prefill_inputs(device: str, shift: int, qsl_dtype: torch.dtype) -> None:
    ops = _kernels(device)
    g = torch.Generator().manual_seed(10 + shift)
    token_ids, _ = _state(g, 400, 16, device)
    s = _step(g, 400, device, shift)
    args = (
        token_ids,
        s["idx_mapping"],
        s["token_req"],
        s["positions"],
        s["query_start_loc"].to(qsl_dtype),  # the draft graphs pass the int32 buffer
        s["num_draft"],
        s["num_acc"],
        shift,
    )
    for name, a, b in zip(
        ("input_ids", "last", "next_pos", "d1_pos"),
        ops.prepare_draft_prefill_inputs(*args),
        sk.prepare_draft_prefill_inputs_ref(*args),
    ):
        _assert_equal(a, b, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("shift", [0, 1])
def test_prepare_draft_decode_inputs(device: str, block_size: int, shift: int) -> None:
    ops = _kernels(device)
    g = torch.Generator().manual_seed(20 + block_size + shift)
    max_model_len = 1030 if block_size == 1 else 200
    token_ids, bt = _state(g, max_model_len, block_size, device)
    B = 7
    rows = torch.cat([torch.randperm(NUM_ROWS - 1, generator=g)[:5], torch.tensor([8, 8])])
    # Up to K past max_model_len: drafting at the end of the context.
    pos = torch.randint(0, max_model_len + K, (B,), generator=g)
    pos[:3] = torch.tensor([max_model_len - 1, max_model_len, max_model_len + K - 1])
    rows, pos = rows.to(device), pos.to(device)
    for with_ids, with_metadata in ((True, True), (True, False), (False, True)):
        args = (token_ids, bt, rows, pos, shift, block_size, max_model_len, with_ids, with_metadata)
        out, ref = ops.prepare_draft_decode_inputs(*args), sk.prepare_draft_decode_inputs_ref(*args)
        for name in ref.__dataclass_fields__:
            a, b = getattr(out, name), getattr(ref, name)
            assert (a is None) == (b is None), name
            if b is not None:
                _assert_equal(a, b, name)
    assert bool((ref.slot_mapping[pos >= max_model_len] == -1).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_advance_decode_metadata(device: str, block_size: int) -> None:
    ops = _kernels(device)
    g = torch.Generator().manual_seed(30 + block_size)
    max_model_len = 1030 if block_size == 1 else 200
    _, bt = _state(g, max_model_len, block_size, device)
    B = 8
    rows = torch.cat([torch.randperm(NUM_ROWS - 1, generator=g)[:6], torch.tensor([8, 8])])
    pos = torch.randint(0, max_model_len, (B,), generator=g)
    # Crossing a page boundary, reaching the end of the table, and the padded rows.
    pos[:3] = torch.tensor([block_size - 1, max_model_len - 2, max_model_len - 1])
    common = sk.prepare_draft_decode_inputs_ref(
        None, bt, rows.to(device), pos.to(device), 0, block_size, max_model_len, False, True
    )
    common.slot_mapping[6:] = -1  # padded rows
    state = [pos.to(device), common.seq_lens, common.slot_mapping, common.block_table]
    ref = [t.clone() for t in state]
    token_req = common.token_req
    for _ in range(3):
        ops.advance_decode_metadata_(*state, token_req, block_size)
        sk.advance_decode_metadata_ref_(*ref, token_req, block_size)
        for name, a, b in zip(("positions", "seq_lens", "slot_mapping"), state, ref):
            _assert_equal(a, b, name)
    assert bool((state[2][6:] == -1).all())


@pytest.mark.parametrize("pdl", [False, True])
def test_step_kernels_pdl_compile(pdl: bool) -> None:
    """With PDL (tunables().pdl_step_kernels) every step bookkeeping kernel compiles
    for sm_90 letting the next kernel launch first thing and waiting for the previous one
    before any load; without it they hold no griddepcontrol at all."""
    pytest.importorskip("triton")
    from specserve.ops import spec_kernels_triton as skt

    from .test_pdl import compile_sm90

    cases = [
        (
            skt._write_verified_tokens_kernel,
            dict(BLOCK_K=8, HAS_ACC=True, HAS_COMPUTED=True),
            {"token_ids_ptr": "*i64", "out_tokens_ptr": "*i64"},
        ),
        (
            skt._prepare_target_inputs_kernel,
            dict(KV_BLOCK_SIZE=16, BLOCK=256, BLOCK_COLS=64, NUM_COL_BLOCKS=1, META=True),
            {"token_ids_ptr": "*i64", "out_ids_ptr": "*i64", "out_slot_ptr": "*i64"},
        ),
    ]
    cases += [
        (skt._place_on_device_kernel, dict(BLOCK=256), {}),
        (skt._prepare_draft_prefill_inputs_kernel, dict(SHIFT=1, BLOCK=256), {}),
        (
            skt._prepare_draft_decode_inputs_kernel,
            dict(SHIFT=1, KV_BLOCK_SIZE=16, WITH_IDS=True, WITH_METADATA=True),
            {},
        ),
        (skt._advance_decode_metadata_kernel, dict(KV_BLOCK_SIZE=16, BLOCK=256), {}),
    ]
    cases[-2][1].update(BLOCK_COLS=64, NUM_COL_BLOCKS=1)
    for kernel, consts, types in cases:
        # Integer buffers throughout (compile_sm90 would type other pointers bf16).
        ints = {n: "*i32" for n in kernel.arg_names if n.endswith("_ptr")}
        ptx = compile_sm90(kernel, dict(consts, PDL=pdl), types={**ints, **types})
        lines = ptx.splitlines()
        marks = [i for i, ln in enumerate(lines) if "griddepcontrol" in ln]
        if not pdl:
            assert not marks
            continue
        assert "launch_dependents" in lines[marks[0]] and "wait" in lines[marks[1]]
        assert all("ld.global" not in ln for ln in lines[: marks[1]])


@pytest.mark.gpu
@needs_cuda
def test_step_kernels_pdl_engine_tokens_gpu(ckpt_dir) -> None:
    """With tunables().pdl_step_kernels the engine (CUDA graphs, async scheduling) gives the tokens it
    gives without: plain decode, greedy and sampled, n-gram speculation (verified tokens
    written back with accept counts) and a draft model (its input kernels on the device)."""
    from specserve import LLM, SamplingParams
    from specserve.tunables import override

    path = ckpt_dir("llama_step_pdl")
    prompts = [{"prompt_token_ids": [5 + i, 9, 13, 5 + i, 9, 13, 7]} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    # A draft model (the target itself): the drafter's input preparation and its decode
    # loop's metadata advance run on the device, in a captured draft loop.
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}

    def run(spec: dict | None) -> list[list[int]]:
        llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                  speculative_config=spec)  # fmt: skip
        outs = llm.generate(prompts, [greedy, sampled, greedy])
        del llm
        return [o.outputs[0].token_ids for o in outs]

    for spec in (None, ngram, draft):
        plain = run(spec)
        with override(pdl_step_kernels=True):
            assert run(spec) == plain


def test_dispatch_on_cpu_is_the_reference() -> None:
    """CPU tensors never reach a kernel: the public functions return the references' results."""
    g = torch.Generator().manual_seed(40)
    token_ids, bt = _state(g, 400, 16, "cpu")
    s = _step(g, 400, "cpu")
    args = (token_ids, bt, s["idx_mapping"], s["token_req"], s["positions"], 16)
    for a, b in zip(sk.prepare_target_inputs(*args), sk.prepare_target_inputs_ref(*args)):
        _assert_equal(a, b, "prepare_target_inputs")
    # Into given buffers (a CUDA graph's inputs), larger than the step.
    T, B = s["positions"].shape[0], s["idx_mapping"].shape[0]
    bufs = (torch.zeros(T + 5, dtype=torch.int64), torch.zeros(T + 5, dtype=torch.int64))
    bufs += (torch.zeros(B + 2, bt.shape[1], dtype=torch.int32),)
    views = (bufs[0][:T], bufs[1][:T], bufs[2][:B])
    got = sk.prepare_target_inputs(*args, out=views)
    for a, b, v in zip(got, sk.prepare_target_inputs_ref(*args), views):
        _assert_equal(v, b, "prepare_target_inputs out=")
        assert a.data_ptr() == v.data_ptr()
    ref = token_ids.clone()
    B = s["idx_mapping"].shape[0]
    out = torch.randint(0, 1000, (B, K + 1), generator=g)
    w = (s["idx_mapping"], s["out_pos0"], out, s["num_acc"], s["samples"])
    sk.write_verified_tokens_(token_ids, *w)
    sk.write_verified_tokens_ref_(ref, *w)
    _assert_equal(token_ids, ref, "write_verified_tokens_")


# ---- verification -----------------------------------------------------------------------------
def _verify_inputs(
    g: torch.Generator,
    B: int,
    k: int,
    vocab: int,
    temps: list[float],
    probs_kind: str,
    filters: bool = False,
) -> tuple[tuple, SamplingTensors]:
    """Random verification inputs whose drafts are accepted often: drafts are the target argmax
    or (with probs) drawn from q, a noisy copy of the target distribution."""
    logits = torch.randn(B, k + 1, vocab, generator=g) * 2
    # A likely token per slot, so that sampled rows accept often too.
    logits.scatter_add_(
        2, torch.randint(0, vocab, (B, k + 1, 1), generator=g), torch.full((B, k + 1, 1), 10.0)
    )
    q = None
    if probs_kind == "none":
        drafts = logits[:, :k].argmax(-1)
        noise = torch.randint(0, vocab, (B, k), generator=g)
        drafts = torch.where(torch.rand(B, k, generator=g) < 0.85, drafts, noise)
    else:
        q_logits = logits[:, :k] + torch.randn(B, k, vocab, generator=g) * 0.5
        q = q_logits.softmax(-1)
        if probs_kind == "one_hot":  # greedy draft rows inside sampled drafting
            q = torch.nn.functional.one_hot(q.argmax(-1), vocab).float()
        if probs_kind == "ones":  # q >= p everywhere: every residual is empty (fallback to p)
            q = torch.ones_like(q)
        drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(B, k)
    drafts[0, -1] = -1  # padding may hold anything
    num_draft = torch.randint(0, k + 1, (B,), generator=g)
    num_draft[:4] = k
    n = len(temps)
    st = SamplingTensors.from_lists(
        [temps[i % n] for i in range(B)],
        [7 if filters and i % 3 == 1 else 0 for i in range(B)],
        [0.8 if filters and i % 3 == 2 else 1.0 for i in range(B)],
        [0.05 if filters and i % 4 == 3 else 0.0 for i in range(B)],
        [1000 * i + 17 for i in range(B)],
        "cpu",
    )
    positions = torch.randint(0, 100_000, (B,), generator=g)
    return (logits, drafts, q, num_draft, positions), st


def _st_to(st: SamplingTensors, device: str) -> SamplingTensors:
    """`st` on `device` in the engine's layout: strided columns of the per-row parameter tables
    (see RequestStates.sampling_tensors)."""
    fp = torch.stack([st.temperature, st.top_p, st.min_p], 1).to(device)
    ip = torch.stack([st.top_k, st.seeds], 1).to(device)
    return SamplingTensors(
        temperature=fp[:, 0],
        top_k=ip[:, 0],
        top_p=fp[:, 1],
        min_p=fp[:, 2],
        seeds=ip[:, 1],
        all_greedy=st.all_greedy,
        any_top_k=st.any_top_k,
        any_top_p=st.any_top_p,
        any_min_p=st.any_min_p,
    )


def _check_verify(
    device: str, args: tuple, st: SamplingTensors, block_v: int | None
) -> tuple[Tensor, Tensor]:
    """Kernel == reference on `device`; returns the reference's (tokens, num_accepted) on CPU."""
    logits, drafts, q, num_draft, positions = (None if t is None else t.to(device) for t in args)
    st = _st_to(st, device)
    ref = rejection_sample_ref(logits, drafts, q, num_draft, st, positions, "probabilistic")
    if block_v is None:
        out = rejection_sample_kernel(logits, drafts, q, num_draft, st, positions)
    else:
        from specserve.sample.rejection_triton import rejection_sample_triton

        out = rejection_sample_triton(
            logits, drafts, q, num_draft, st.temperature, st.seeds, positions,
            st.all_greedy, None, block_v=block_v,
        )  # fmt: skip
    _assert_equal(out[0], ref[0], "tokens")
    _assert_equal(out[1], ref[1], "num_accepted")
    return ref[0].cpu(), ref[1].cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("probs_kind", ["none", "softmax"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's log(0) = -inf in the interpreter
def test_verify_matches_reference(device: str, k: int, probs_kind: str) -> None:
    """Greedy-only batches (strict) and mixed greedy / sampled batches, several vocab splits."""
    g = torch.Generator().manual_seed(50 + k)
    accepted = []
    for temps in ([0.0], [0.0, 1.0, 0.7, 1.3]):
        args, st = _verify_inputs(g, 12, k, 300, temps, probs_kind)
        for block_v in (64, 128, None):  # 5, 3 and 1 splits of the vocabulary
            accepted.append(_check_verify(device, args, st, block_v)[1])
    acc = torch.cat(accepted)
    # The inputs exercise early rejections as well as all-accepted rows (bonus tokens).
    assert bool((acc == 0).any()) and bool((acc == k).any())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("probs_kind", ["none", "softmax", "one_hot", "ones"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_verify_filters_and_edge_cases(device: str, probs_kind: str) -> None:
    """top-k / top-p / min-p (logits processed by torch, then the kernels), one-hot q (the
    residual is p without the draft) and q >= p (empty residual after a rejection: p)."""
    g = torch.Generator().manual_seed(60)
    for filters in (False, True):
        args, st = _verify_inputs(g, 16, 4, 2500, [0.9, 0.0, 1.1], probs_kind, filters)
        _check_verify(device, args, st, None)  # 2500: two splits of the default 2048


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("greedy_draft", [False, True])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_verify_markov_chain(
    device: str, greedy_draft: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lossless test of tests/test_sampling.py through the kernels: the kernels return the
    reference's tokens on every trial, and (on CUDA, with all 20,000 trials) the first two
    tokens follow the target distribution."""
    from . import test_sampling as ts

    if device == "cpu":
        monkeypatch.setattr(ts, "B", 100)  # the interpreter is slow

    def verifier(*args: Tensor) -> tuple[Tensor, Tensor]:
        logits, drafts, q, num_draft, st, positions = args
        return _check_verify(device, (logits, drafts, q, num_draft, positions), st, None)

    tables = ts.markov_chain(seed=5, draft_noise=0.4 if greedy_draft else 1.0)
    first, second = ts.first_two_tokens(verifier, tables, greedy_draft, 1, counter_drafts=True)
    if device == "cuda":
        p1, p2 = ts.target_pvalues(first, second, tables[0])
        assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_verify_acceptance_at_the_boundary(device: str) -> None:
    """Sampled acceptance with u * q(d) set 1e-5 (relative) below or above p(d): the kernels must
    decide as the reference does, i.e. compute p(d) to much better than 1e-5."""
    from specserve.sample.gumbel import SALT_ACCEPT, uniform

    g = torch.Generator().manual_seed(70)
    B, V = 32, 50
    logits = torch.randn(B, 2, V, generator=g) * 2
    drafts = torch.randint(0, V, (B, 1), generator=g)
    temps = [1.0, 0.8]
    st = SamplingTensors.from_lists(
        [temps[i % 2] for i in range(B)], [0] * B, [1.0] * B, [0.0] * B, list(range(B)), "cpu"
    )
    lk = logits[:, 0] / st.temperature[:, None]
    p_d = (lk.gather(1, drafts) - lk.logsumexp(-1, keepdim=True)).exp().squeeze(1)
    # A position per row whose acceptance uniform exceeds p(d), so that q(d) stays below 1.
    cand = torch.randint(0, 100_000, (B, 64), generator=g)
    u = uniform(st.seeds[:, None].expand(B, 64).reshape(-1), cand.reshape(-1), SALT_ACCEPT)
    u = u.view(B, 64)
    first = (u > 1.1 * p_d[:, None]).float().argmax(1)
    positions, u = cand[torch.arange(B), first], u[torch.arange(B), first]
    below = torch.arange(B) % 4 < 2
    q_d = p_d / u * torch.where(below, 1 - 1e-5, 1 + 1e-5)
    q = ((1 - q_d) / (V - 1))[:, None, None].expand(B, 1, V).clone()
    q.scatter_(2, drafts[:, :, None], q_d[:, None, None])
    args = (logits, drafts, q, torch.ones(B, dtype=torch.int64), positions)
    _, acc = _check_verify(device, args, st, None)
    assert torch.equal(acc, below.long())  # the construction is right: accept iff below


def _coupled_cases(
    g: torch.Generator, device: str
) -> Iterator[tuple[tuple[Tensor, Tensor, Tensor], SamplingTensors, list[Tensor], SamplingTensors]]:
    """Verification inputs for the coupled kernels: greedy, mixed, and filtered rows over
    several vocab splits -> (CPU inputs, their SamplingTensors, the same on `device`)."""
    for temps, filters, vocab in (([0.0], False, 300), ([0.0, 1.0, 0.7], False, 300),
                                  ([0.9, 0.0, 1.1], True, 2500)):  # fmt: skip
        (logits, drafts, _, num_draft, positions), st = _verify_inputs(
            g, 12, 3, vocab, temps, "none", filters
        )
        args = [t.to(device) for t in (logits, drafts, num_draft, positions)]
        yield (logits, num_draft, positions), st, args, _st_to(st, device)


def _check_coupled_kernels(
    args: list[torch.Tensor], dst: SamplingTensors, ref: tuple, label: str, **kw: float
) -> None:
    """`coupled_sample_triton` over `args` (logits, drafts, num_draft, positions) equals `ref`
    at two vocabulary block sizes; `kw`: its synthetic_rate."""
    from specserve.sample.rejection import _processed_rows
    from specserve.sample.rejection_triton import coupled_sample_triton

    for block_v in ({"block_v": 64}, {}):
        out = coupled_sample_triton(
            args[0], args[1], args[2], dst.temperature, dst.seeds, args[3],
            dst.all_greedy, _processed_rows(args[0], dst), **block_v, **kw,
        )  # fmt: skip
        _assert_equal(out[0], ref[0], f"{label} tokens")
        _assert_equal(out[1], ref[1], f"{label} num_accepted")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_coupled_verify_matches_reference_and_plain_sampling(device: str) -> None:
    """ "coupled": kernels == reference (greedy, mixed, filtered rows, several vocab splits), and
    every output slot is what `sample` draws at that position from the same logits (plain
    decoding's token), however many drafts were accepted."""
    from specserve.sample.sampler import sample

    accepted = []
    for (logits, _, positions), st, args, dst in _coupled_cases(
        torch.Generator().manual_seed(80), device
    ):
        ref = rejection_sample_ref(args[0], args[1], None, args[2], dst, args[3], "coupled")
        _check_coupled_kernels(args, dst, ref, "coupled")
        toks, n_acc = ref[0].cpu(), ref[1].cpu()
        for j in range(4):
            plain = sample(logits[:, j], st, positions + j)
            valid = j <= n_acc
            assert torch.equal(toks[valid, j], plain[valid])
        accepted.append(n_acc)
    acc = torch.cat(accepted)
    assert bool((acc == 0).any()) and bool((acc == 3).any())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_synthetic_verify_kernels_match_reference(device: str) -> None:
    """ "synthetic" (the benchmarks' fixed acceptance rate) through the coupled kernels ==
    the reference: the same drafts accepted (keyed by seed and position), the accepted drafts
    then the target's draw at the next slot (greedy, mixed, filtered rows, vocab splits)."""
    accepted = []
    for (_, num_draft, _), _, args, dst in _coupled_cases(
        torch.Generator().manual_seed(81), device
    ):
        for rate in (0.0, 0.6, 1.0):
            ref = rejection_sample_ref(
                args[0], args[1], None, args[2], dst, args[3], "synthetic", rate
            )
            _check_coupled_kernels(args, dst, ref, f"synthetic, rate {rate}", synthetic_rate=rate)
            if rate == 1.0:
                assert torch.equal(ref[1].cpu(), num_draft)
            if rate == 0.6:
                accepted.append(ref[1].cpu())
    acc = torch.cat(accepted)
    assert bool((acc == 0).any()) and bool((acc == 3).any())


def test_coupled_accept_compiles_for_sm90() -> None:
    """The coupled acceptance kernel compiles for sm_90 with and without the synthetic
    acceptance test (no GPU needed: the interpreter does not type-check as the compiler
    does)."""
    pytest.importorskip("triton")
    from specserve.sample.gumbel import _MUL1
    from specserve.sample.rejection_kernels import _coupled_accept_kernel as kernel

    from .test_pdl import compile_sm90

    types = {n: "*i64" for n in kernel.arg_names if n.endswith("_ptr")}
    types.update(tok_val_ptr="*fp32", tok_idx_ptr="*i32", synthetic_rate="fp32")
    for synthetic in (False, True):
        consts = dict(K=3, BLOCK_K=4, BLOCK_S=64, SYNTHETIC=synthetic)
        ptx = compile_sm90(kernel, consts, 1, types=types)
        # the synthetic test hashes (seed, position): gumbel.py's first multiplier, in decimal
        assert (str(_MUL1) in ptx) == synthetic


@pytest.mark.gpu
@needs_cuda
def test_kernels_replay_in_a_cuda_graph() -> None:
    """Draft decode inputs, the in-place advance and verification captured in one CUDA graph, as
    the draft graphs use them: replays on new data in the same buffers match the references."""
    g = torch.Generator().manual_seed(80)
    max_model_len, bs, B, vocab = 200, 16, 5, 300
    token_ids, bt = _state(g, max_model_len, bs, "cuda")
    rows = torch.tensor([3, 0, 5, 8, 8], device="cuda")
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    args, st = _verify_inputs(g, B, K, vocab, [0.0, 1.0, 0.7], "softmax")
    bufs = [t.cuda() for t in args]  # logits, drafts, q, num_draft, positions
    st = _st_to(st, "cuda")

    def body() -> tuple:
        x = sk.prepare_draft_decode_inputs(token_ids, bt, rows, pos, 1, bs, max_model_len)
        sk.advance_decode_metadata_(pos, x.seq_lens, x.slot_mapping, x.block_table, x.token_req, bs)
        return x, rejection_sample_kernel(bufs[0], bufs[1], bufs[2], bufs[3], st, bufs[4])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, (tokens, num_acc) = body()
    for _ in range(3):
        p0 = torch.randint(0, max_model_len + K, (B,), generator=g).cuda()
        pos.copy_(p0)
        new_args, new_st = _verify_inputs(g, B, K, vocab, [0.0, 1.0, 0.7], "softmax")
        for buf, t in zip(bufs, new_args):
            buf.copy_(t)
        st.seeds.copy_(new_st.seeds)
        graph.replay()
        ref = sk.prepare_draft_decode_inputs_ref(
            token_ids, bt, rows, p0.clone(), 1, bs, max_model_len
        )
        sk.advance_decode_metadata_ref_(
            p0, ref.seq_lens, ref.slot_mapping, ref.block_table, ref.token_req, bs
        )
        _assert_equal(pos, p0, "positions")
        for name in ref.__dataclass_fields__:
            _assert_equal(getattr(x, name), getattr(ref, name), name)
        ref_tok, ref_acc = rejection_sample_ref(
            bufs[0], bufs[1], bufs[2], bufs[3], st, bufs[4], "probabilistic"
        )
        _assert_equal(tokens, ref_tok, "tokens")
        _assert_equal(num_acc, ref_acc, "num_accepted")

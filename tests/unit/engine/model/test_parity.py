"""Logits and greedy tokens equal transformers on the same random weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from services.engine.model import load_model, paged_attention
from services.engine.model.linear import small_gemm_rows_invariant

from .paged import PagedCache, greedy

TOL = 1e-4  # max abs logits difference, fp32 (different matmul order only)
LENGTHS = (1, 7, 33, 100)

CASES = {
    "llama": {"arch": "llama"},
    "llama-tied": {"arch": "llama", "tie_word_embeddings": True},
    "llama3-rope": {"arch": "llama", "rope_theta": 500000.0, "max_position_embeddings": 1024,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}},
    "llama-linear-rope": {"arch": "llama",
                              "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "mistral": {"arch": "mistral", "sliding_window": None},
    "qwen2": {"arch": "qwen2"},
    "qwen2-mha-tied": {"arch": "qwen2", "num_key_value_heads": 4, "tie_word_embeddings": True},
}


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest):
    """Intra-op threads while the model loads and runs: with one, its small float32 weights
    are computed by MKL (linear.py), with two by oneDNN; both must be batch-invariant."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _kernels_as_threads_say(model, threads: int) -> None:
    """One thread: MKL for each weight whose shape this host's MKL computes row-invariantly
    (AVX-512 hosts fail the check for some shapes, AVX2 ones pass it); two: oneDNN only."""
    for lin in model.linears():
        w = lin.weight
        assert lin.on_mkl == (threads == 1 and small_gemm_rows_invariant(w, lin.b))


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(5, 1024, (n,), generator=g).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(hf_checkpoint, case: str) -> None:
    folder, ref = hf_checkpoint(**CASES[case])
    ours = load_model(folder, dtype=torch.float32)
    for n in LENGTHS:
        prompt = _prompt(n)
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0].float()  # (n, vocab)
        # All positions' logits: ask for every row of the packed batch.
        cache = PagedCache(ours.model, 1, n)
        batch = cache.batch([prompt], [0])
        batch.logits_indices = torch.arange(n)
        got = ours.model(batch, cache.kv_cache)
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"{case} n={n}: max abs diff {diff}"


@pytest.mark.parametrize("case", ["llama", "qwen2", "llama3-rope"])
def test_greedy_32_tokens_match_transformers_generate(hf_checkpoint, case: str) -> None:
    folder, ref = hf_checkpoint(**CASES[case])
    ours = load_model(folder, dtype=torch.float32)
    prompt = _prompt(13)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert greedy(ours.model, prompt, 32) == want


def test_chunked_prefill_equals_one_shot(hf_checkpoint, threads: int) -> None:
    folder, _ = hf_checkpoint(arch="llama")
    model = load_model(folder, dtype=torch.float32).model
    _kernels_as_threads_say(model, threads)
    prompt = _prompt(57)
    full = PagedCache(model, 1, 64).step([prompt], [0])
    chunked = PagedCache(model, 1, 64)
    done = 0
    for size in (1, 16, 5, 30, 5):  # chunk edges inside and on block boundaries
        logits = chunked.step([prompt[done:done + size]], [done])
        done += size
    assert done == len(prompt)
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)


# Decode groups (paged_attention.group_by_length): 0 = a group per distinct context
# length, the default, and one group for every decode.
GROUPINGS = (0, None, 10**9)


def _grouping(monkeypatch, call_keys: int | None) -> None:
    if call_keys is not None:
        monkeypatch.setattr(paged_attention, "GROUP_CALL_KEYS", call_keys)


@pytest.mark.parametrize("call_keys", GROUPINGS)
def test_mixed_batch_equals_sequences_alone(hf_checkpoint, monkeypatch, call_keys,
                                            threads: int) -> None:
    """Prefill chunks and decodes of different sequences in one step give each sequence's
    own logits."""
    _grouping(monkeypatch, call_keys)
    folder, _ = hf_checkpoint(arch="qwen2")
    model = load_model(folder, dtype=torch.float32).model
    _kernels_as_threads_say(model, threads)
    prompts = [_prompt(n, seed=7) for n in (9, 21, 3, 40)]
    alone = [PagedCache(model, 1, 48).step([p], [0])[0] for p in prompts]
    cache = PagedCache(model, 4, 48)
    # Step 1: sequences 0 and 2 minus their last token, sequence 3 a first chunk.
    cache.step([prompts[0][:-1], [], prompts[2][:-1], prompts[3][:25]], [0, 0, 0, 0])
    # Step 2: two decodes, one whole prefill, one continued chunk, all together.
    logits = cache.step([prompts[0][-1:], prompts[1], prompts[2][-1:], prompts[3][25:]],
                        [8, 0, 2, 25])
    for s in range(4):
        torch.testing.assert_close(logits[s], alone[s], atol=1e-5, rtol=0)


@pytest.mark.parametrize("call_keys", GROUPINGS)
def test_batched_decode_equals_single(hf_checkpoint, monkeypatch, call_keys,
                                      threads: int) -> None:
    _grouping(monkeypatch, call_keys)
    folder, _ = hf_checkpoint(arch="llama", num_key_value_heads=1)
    model = load_model(folder, dtype=torch.float32).model
    _kernels_as_threads_say(model, threads)
    prompts = [_prompt(n, seed=3) for n in (5, 17, 30)]
    singles = [greedy(model, p, 12) for p in prompts]
    cache = PagedCache(model, 3, 48)
    logits = cache.step(prompts, [0, 0, 0])
    outs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(11):
        cached = [len(p) + len(o) - 1 for p, o in zip(prompts, outs, strict=True)]
        logits = cache.step([[o[-1]] for o in outs], cached)
        for o, t in zip(outs, logits.argmax(-1), strict=True):
            o.append(int(t))
    assert outs == singles


def test_wait_for_layer_called_in_order_before_each_layer(hf_checkpoint) -> None:
    folder, _ = hf_checkpoint(arch="llama", num_hidden_layers=3)
    model = load_model(folder, dtype=torch.float32).model
    cache = PagedCache(model, 1, 16)
    batch = cache.batch([_prompt(6)], [0])
    calls: list[int] = []
    batch.wait_for_layer = calls.append
    model(batch, cache.kv_cache)
    assert calls == [0, 1, 2]


def test_bf16_upcast_linears_match_plain_bf16(demo_tiny) -> None:
    """Half-precision linears computed in float32 (for many rows on CPUs without native
    bf16) agree with plain bf16 GEMMs up to bf16 rounding."""
    model = load_model(demo_tiny, dtype=torch.bfloat16).model
    prompt = _prompt(40)
    model.set_upcast_rows(0)
    plain = PagedCache(model, 1, 48).step([prompt], [0])
    model.set_upcast_rows(1)
    upcast = PagedCache(model, 1, 48).step([prompt], [0])
    ref = load_model(demo_tiny, dtype=torch.float32).model
    exact = PagedCache(ref, 1, 48).step([prompt], [0])
    assert (plain - upcast).abs().max().item() < 0.02
    assert (upcast - exact).abs().max().item() < 0.02


@pytest.mark.parametrize("tied", [False, True])
def test_float32_cpu_model_holds_each_linear_weight_once(hf_checkpoint, tied: bool) -> None:
    """Float32 CPU linears (two threads: oneDNN) run on oneDNN-packed weights that replace
    the plain ones (no second copy); a tied head stays plain, as the embedding lookup reads
    it."""
    from services.engine.model.linear import pack_float32

    assert pack_float32(torch.zeros(4, 4)) is not None, "the pinned torch build has oneDNN"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _holds_each_weight_once(hf_checkpoint, tied)
    finally:
        torch.set_num_threads(before)


def _holds_each_weight_once(hf_checkpoint, tied: bool) -> None:
    folder, ref = hf_checkpoint(arch="llama", tie_word_embeddings=tied)
    model = load_model(folder, dtype=torch.float32).model
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(("qkv_w", "o_w", "gate_up_w", "down_w")) for n in names)
    assert all(lin.w is None for layer in model.layers for lin in layer.linears())
    assert (model.head.w is not None) == tied and (model.lm_head is not None) == tied
    want = ref.lm_head.weight.detach()
    assert torch.equal(model.head.weight, want)


def _mixed_step(cache: PagedCache, prompts: list[list[int]]):
    """A step with a decode, a whole prompt and a continued chunk (after a first step)."""
    cache.step([prompts[0][:-1], [], prompts[2][:12]], [0, 0, 0])
    return cache.batch([prompts[0][-1:], prompts[1], prompts[2][12:]],
                       [len(prompts[0]) - 1, 0, 12])


@pytest.mark.parametrize("call_keys", GROUPINGS)
def test_last_layer_output_rows_equal_every_row(hf_checkpoint, monkeypatch, call_keys) -> None:
    """The last layer computed only at the logits rows (one-token queries over each row's
    causal context) gives the logits of the full computation at those rows, for the last
    row of each sequence and for any other rows, several of one sequence among them."""
    _grouping(monkeypatch, call_keys)
    folder, _ = hf_checkpoint(arch="qwen2", num_hidden_layers=3)
    model = load_model(folder, dtype=torch.float32).model
    prompts = [_prompt(n, seed=11) for n in (10, 19, 33)]
    full_cache = PagedCache(model, 3, 48)
    batch = _mixed_step(full_cache, prompts)
    t = batch.num_tokens
    batch.logits_indices = torch.arange(t)  # every row: nothing skipped
    every = model(batch, full_cache.kv_cache)
    for rows in ([0, 19, t - 1], [t - 1, 3, 4, 19, 20], [5], [1, 2, 25, 26, 27]):
        cache = PagedCache(model, 3, 48)
        batch = _mixed_step(cache, prompts)
        batch.logits_indices = torch.tensor(rows)
        got = model(batch, cache.kv_cache)
        torch.testing.assert_close(got, every[rows], atol=1e-5, rtol=0)
        # The K/V of every row was still written: the caches agree.
        torch.testing.assert_close(cache.kv_cache, full_cache.kv_cache, atol=1e-6, rtol=0)


def test_last_layer_runs_only_at_logits_rows(hf_checkpoint) -> None:
    """A prompt's last layer computes its MLP for the last token alone; the other layers
    for every token."""
    folder, _ = hf_checkpoint(arch="llama", num_hidden_layers=3)
    model = load_model(folder, dtype=torch.float32).model
    seen: dict[int, list[int]] = {}
    for i, layer in enumerate(model.layers):
        inner = layer.down

        def down(x, upcast_rows, i=i, inner=inner):
            seen.setdefault(i, []).append(x.shape[0])
            return inner(x, upcast_rows)

        layer.down = down
    cache = PagedCache(model, 2, 32)
    cache.step([_prompt(20), _prompt(7)], [0, 0])
    assert seen == {0: [27], 1: [27], 2: [2]}


def test_prompt_first_logits_do_not_depend_on_the_batch(hf_checkpoint, threads: int) -> None:
    """A prompt's first-token logits are bitwise the same alone and in a step with another
    prompt (its last-layer row gets an attention call of its own)."""
    folder, _ = hf_checkpoint(arch="llama", num_hidden_layers=3)
    model = load_model(folder, dtype=torch.float32).model
    _kernels_as_threads_say(model, threads)
    p, q = _prompt(37, seed=5), _prompt(20, seed=9)
    alone_p = PagedCache(model, 1, 64).step([p], [0])[0]
    alone_q = PagedCache(model, 1, 64).step([q], [0])[0]
    both = PagedCache(model, 2, 64).step([p, q], [0, 0])
    assert torch.equal(both[0], alone_p) and torch.equal(both[1], alone_q)


def test_decode_step_with_an_idle_sequence(hf_checkpoint) -> None:
    """An all-decode step whose batch also holds a sequence with no new token: the others
    still attend their own keys (the single-group fast path needs a row per sequence)."""
    folder, _ = hf_checkpoint(arch="llama", num_hidden_layers=2)
    model = load_model(folder, dtype=torch.float32).model
    cache = PagedCache(model, 3, 32)
    cache.step([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [0, 0, 0])
    want = PagedCache(model, 3, 32)
    want.step([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [0, 0, 0])
    expected = want.step([[20], [], [21]], [3, 2, 4])
    batch = cache.batch([[20], [], [21]], [3, 2, 4])
    batch.q_lens, batch.kv_lens = [1, 0, 1], [4, 2, 5]  # the idle sequence put back
    batch.block_tables = [t[[0, 1, 2]] for t in cache.tables]
    batch.logits_indices = torch.tensor([0, 1])
    got = model(batch, cache.kv_cache)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_decoded_kv_equals_prefilled_kv_bitwise(hf_checkpoint, threads: int) -> None:
    """The first layer's K/V written while decoding (one row a step, beside another
    sequence) are bit for bit those a prefill of the same tokens writes: its linears, norm
    and rotation give a row the same bits whatever rows share the step. (Deeper layers take
    attention outputs, computed by other kernels for one query than for a chunk; their
    tokens are compared by the greedy tests.)"""
    folder, _ = hf_checkpoint(arch="llama", num_hidden_layers=2)
    model = load_model(folder, dtype=torch.float32).model
    _kernels_as_threads_say(model, threads)
    prompt, other = _prompt(21, seed=4), _prompt(9, seed=6)
    decoded = PagedCache(model, 2, 48)
    logits = decoded.step([prompt, other], [0, 0])
    outs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(10):
        cached = [len(p) + len(o) - 1 for p, o in zip((prompt, other), outs, strict=True)]
        logits = decoded.step([[o[-1]] for o in outs], cached)
        for o, t in zip(outs, logits.argmax(-1), strict=True):
            o.append(int(t))
    tokens = prompt + outs[0][:-1]  # every token whose K/V the decoding wrote
    prefilled = PagedCache(model, 2, 48)
    prefilled.step([tokens, []], [0, 0])
    blocks = decoded.tables[0][0][: -(-len(tokens) // decoded.block_size)]
    a, b = decoded.kv_cache[blocks], prefilled.kv_cache[blocks]
    n = len(tokens) - (len(blocks) - 1) * decoded.block_size  # rows of the last block
    assert torch.equal(a[:-1], b[:-1]) and torch.equal(a[-1][:, :n], b[-1][:, :n])


@pytest.mark.parametrize("tied", [False, True])
def test_small_weights_on_one_thread_are_held_once_as_copies(hf_checkpoint, tied: bool) -> None:
    """On one thread the small float32 weights stay plain for MKL, each the linear's own copy
    (not a view of the checkpoint's file: page cache may be paged out while idle), which the
    parameter shares; the untied head too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder, ref = hf_checkpoint(arch="llama", tie_word_embeddings=tied)
        model = load_model(folder, dtype=torch.float32).model
    finally:
        torch.set_num_threads(before)
    if not all(lin.on_mkl for lin in model.linears()):
        pytest.skip("this host's MKL gives a row other bits by row count for some of these "
                    "shapes: they stay on oneDNN (checked by the parity tests)")
    for layer in model.decoder_layers:
        for name, lin in zip(("qkv_w", "o_w", "gate_up_w", "down_w"), layer.linears(),
                             strict=True):
            assert lin.on_mkl and getattr(layer, name).data_ptr() == lin.w.data_ptr()
            # Its own storage, not a window on the checkpoint's mapped file.
            assert lin.w.untyped_storage().nbytes() == lin.w.numel() * 4
    assert model.head.on_mkl and torch.equal(model.head.weight, ref.lm_head.weight.detach())
    if tied:
        assert model.head.w.data_ptr() != model.embed.data_ptr()
    else:
        assert model.lm_head is not None and model.lm_head.data_ptr() == model.head.w.data_ptr()

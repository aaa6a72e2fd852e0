from __future__ import annotations

import torch

from services.engine.api_types import SamplingParams
from services.engine.output_state import OutputState
from services.engine.sampling import Sampler, make_generator, top_k_top_p_mask


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert Sampler().sample(logits, [SamplingParams()] * 2, [make_generator(0)] * 2) == [1, 0]


def test_top_k_mask() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    drop = top_k_top_p_mask(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert drop.tolist() == [[True, False, False, True], [False] * 4]


def test_top_p_mask_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = ~top_k_top_p_mask(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert keep.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 >= 0.7
    keep = ~top_k_top_p_mask(logits, torch.tensor([0]), torch.tensor([0.01]))
    assert keep.tolist() == [[True, False, False, False]]  # the top token always stays


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7)
    alone = [
        Sampler().sample(logits[2:3], [p], [g])[0] for g in [make_generator(7)] for _ in range(5)
    ]
    gens = [make_generator(s) for s in (1, 2, 7, 3)]
    batched = [Sampler().sample(logits, [p] * 4, gens)[2] for _ in range(5)]
    assert alone == batched
    other = make_generator(8)
    assert [Sampler().sample(logits[2:3], [p], [other])[0] for _ in range(5)] != alone


def test_temperature_sampling_respects_the_masks() -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 8.0]])
    p = SamplingParams(temperature=2.0, top_k=2)
    g = make_generator(0)
    seen = {Sampler().sample(logits, [p], [g])[0] for _ in range(200)}
    assert seen == {2, 3}


class CharDetok:
    """One character per token id (id = ord)."""

    def add(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def flush(self) -> str:
        return ""


def feed(state: OutputState, text: str) -> list[str]:
    out = []
    for ch in text:
        state.add(ord(ch))
        out.append(state.take_text())
        if state.finish_reason:
            break
    return out


def test_stop_string_across_tokens_is_cut_and_never_streamed() -> None:
    st = OutputState(CharDetok(), SamplingParams(stop=("END",)), (), 100)
    deltas = feed(st, "abcENxEND tail")
    assert st.finish_reason == "stop"
    assert "".join(deltas) == "abcENx"
    assert all("END" not in d for d in deltas)
    assert deltas[:3] == ["", "", "a"]  # 2 characters held back (len("END") - 1)


def test_earliest_of_several_stop_strings_wins() -> None:
    st = OutputState(CharDetok(), SamplingParams(stop=("zz", "yzz")), (), 100)
    assert "".join(feed(st, "ab yzz")) == "ab "


def test_stop_token_and_eos() -> None:
    st = OutputState(CharDetok(), SamplingParams(stop_token_ids=(ord("!"),)), (ord("$"),), 100)
    assert "".join(feed(st, "hi!there")) == "hi" and st.finish_reason == "stop"
    st = OutputState(CharDetok(), SamplingParams(), (ord("$"),), 100)
    assert "".join(feed(st, "ok$more")) == "ok" and st.num_tokens == 3
    st = OutputState(CharDetok(), SamplingParams(ignore_eos=True), (ord("$"),), 5)
    assert "".join(feed(st, "ok$more")) == "ok$mo" and st.finish_reason == "length"


def test_max_tokens_flushes_held_back_text() -> None:
    st = OutputState(CharDetok(), SamplingParams(stop=("xyz",)), (), 3)
    assert "".join(feed(st, "abcdef")) == "abc" and st.finish_reason == "length"

"""The transformers side of ``bench.engine.speed``: ``LlamaForCausalLM.generate()`` greedy
on a left-padded batch, timed by a streamer (first new token = prefill done)."""

from __future__ import annotations

import time

import torch

from bench.engine.speed_workload import BATCHES, prompts


class _Clock:
    """A generate() streamer that only notes when tokens arrive: the first put() is the
    prompt, the second the first new token (prefill done), the last the final token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(model: str, prompt_len: int, gen: int, dtype: str) -> dict:
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    vocab = m.config.vocab_size

    def run(batch: list[list[int]], new: int) -> tuple[float, float]:
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        clock = _Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            m.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        return clock.times[1] - t0, clock.times[-1] - clock.times[1]

    run(prompts(1, prompt_len, vocab, seed=99), 4)  # warm-up
    out = {}
    for b in BATCHES:
        t_pre, t_dec = run(prompts(b, prompt_len, vocab), gen)
        out[b] = (b * prompt_len / t_pre, b * (gen - 1) / t_dec)
    return out

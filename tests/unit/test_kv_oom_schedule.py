"""Injected KV out-of-memory failures in random n > 1 workloads under a small budget (fake
runner): no hang, every request finishes, outputs exact. Seed 96 once hung for good: a
retracted leader re-queued behind its follower."""

from __future__ import annotations

import random

import pytest

from tandem.engine.engine import Engine
from tandem.engine.plan import KVOutOfMemory
from tandem.engine.scheduler import SchedulerConfig
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRunner, fake_token


class OOMRunner(FakeRunner):
    """Fails a share of the fresh steps that grow the pool, emptying it like the real one."""

    def __init__(self, rng: random.Random, p: float) -> None:
        super().__init__()
        self.rng, self.p, self.ooms = rng, p, 0

    def launch(self, plan, parent, masks=None):
        if not plan.chained and plan.capacity > self.capacity and self.rng.random() < self.p:
            held = self.capacity * 8
            self.kv, self.capacity = {}, 0
            self.ooms += 1
            raise KVOutOfMemory(held, plan.capacity * 8, "injected")
        return super().launch(plan, parent, masks)


def expected(seed: int, prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(fake_token(seed, seq))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("seed", [*range(12), 96])
def test_oom_recovery_with_followers_never_hangs(seed):
    rng = random.Random(seed)
    runner = OOMRunner(rng, 0.3)
    cfg = SchedulerConfig(
        max_num_seqs=6,
        max_model_len=512,
        kv_budget_tokens=rng.choice([600, 900, 1500]),
        capacity_chunk=16,
        row_chunk=1,
        max_num_batched_tokens=64,
    )
    engine = Engine(runner, cfg, overlap=rng.random() < 0.5, check_invariants=True)
    specs = []
    for i in range(14):
        at = rng.randrange(0, 60)
        prompt = [rng.randrange(0, 900) for _ in range(rng.randint(1, 50))]
        for j in range(rng.choice([1, 2, 3])):
            params = SamplingParams(max_tokens=rng.randint(5, 80), seed=i * 10 + j, ignore_eos=True)
            specs.append((at, f"r{i}.{j}", prompt, params, f"r{i}.0" if j else None))
    specs.sort(key=lambda s: s[0])
    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    step = 0
    while step < 60 or engine.has_unfinished():
        for at, rid, prompt, params, follows in specs:
            if at == step:
                try:
                    engine.add_request(prompt, params, rid, follows=follows)
                except ValueError:
                    done[rid] = "rejected"
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                done[out.request_id] = out.finish_reason
        step += 1
        assert step < 3000, f"hung: waiting {[r.request_id for r in engine.scheduler.waiting]}"
    assert set(done) == {rid for _, rid, *_ in specs}
    for _, rid, prompt, params, _ in specs:
        if done[rid] == "length":
            assert tokens[rid] == expected(params.seed, prompt, params.max_tokens), rid
    if seed == 96:
        assert runner.ooms > 0

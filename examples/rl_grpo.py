"""GRPO on CPU with the default model, on-policy to the bit: KL(sampler || trainer) = 0.0.

Each step: roll out groups of samples with samebits (seeded, temperature 1), score them with a
verifiable reward (the first number in the answer is the sum asked for), recompute the sampled
tokens' logprobs with gradients in ``TrainableLM`` (the engine's own model code), take a
policy-gradient step on the group-normalised advantages, and push the new weights into the engine
with ``llm.update_weights``. The importance ratio exp(trainer - sampler) is exactly 1 and the KL
estimate exactly 0.0 in the default (batch-invariant) mode; ``--standard`` runs stock kernels,
where the trainer's prefill does not reproduce the sampler's decode and the KL is not 0.

    python examples/rl_grpo.py --steps 10 --plot grpo.png
    python examples/rl_grpo.py --steps 10 --standard
"""

from __future__ import annotations

import argparse
import json
import random
import re

import torch

from samebits import LLM, SamplingParams
from samebits.tools.verify import plot_file
from samebits.train import TrainableLM


def make_prompts(n: int, step: int) -> list[tuple[str, int]]:
    """``n`` addition questions (prompt text, answer), different every step, seeded."""
    rng = random.Random(1000 + step)
    pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(n)]
    return [(f"Question: what is {a} + {b}?\nAnswer: {a} + {b} =", a + b) for a, b in pairs]


def reward(text: str, answer: int) -> float:
    """1.0 when the first number in the completion is the right sum, else 0.0 (verifiable)."""
    m = re.search(r"-?\d+", text)
    return 1.0 if m is not None and int(m.group()) == answer else 0.0


def grpo_step(llm: LLM, tl: TrainableLM, opt: torch.optim.Optimizer, step: int,
              args: argparse.Namespace) -> dict:
    questions = make_prompts(args.prompts, step)
    prompts = [q for q, _ in questions for _ in range(args.group_size)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                             seed=args.seed + 10_000 * step + i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    rewards = torch.tensor([reward(o.outputs[0].text, questions[i // args.group_size][1])
                            for i, o in enumerate(outs)])
    groups = rewards.view(args.prompts, args.group_size)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    trainer = tl.logprobs(seqs, [len(o.prompt_token_ids) for o in outs])
    sampler = [torch.tensor(o.outputs[0].token_logprobs) for o in outs]
    diff = torch.cat([t.detach() - s for t, s in zip(trainer, sampler, strict=True)]).double()
    kl = float((torch.exp(diff) - diff - 1).mean())  # k3 estimate of KL(sampler || trainer), fp64
    # GRPO surrogate: ratio exp(trainer - sampler) (exactly 1 when on-policy) times the advantage
    loss = -torch.stack([(torch.exp(t - s) * a).mean()
                         for t, s, a in zip(trainer, sampler, adv, strict=True)]).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    fingerprint = llm.update_weights(tl.named_weights())
    return {"step": step, "reward": float(rewards.mean()), "max_abs_logprob_diff":
            float(diff.abs().max()), "kl": kl, "loss": loss.item(), "fingerprint": fingerprint}


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    llm = LLM(batch_invariant=not args.standard, num_kv_blocks=args.kv_blocks, seed=args.seed)
    tl = TrainableLM.from_llm(llm)
    opt = torch.optim.Adam(tl.parameters(), lr=args.lr)
    records = []
    for step in range(args.steps):
        rec = grpo_step(llm, tl, opt, step, args)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if args.plot:
        plot(records, args.plot, "standard" if args.standard else "batch-invariant")
    return records


def plot(records: list[dict], path: str, mode: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(steps, [r["reward"] for r in records], marker="o")
    ax1.set(title=f"reward ({mode})", xlabel="step")
    ax2.plot(steps, [r["kl"] for r in records], marker="o", color="tab:red")
    ax2.set(title="KL(sampler || trainer)", xlabel="step")
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=2, help="questions per step")
    p.add_argument("--group-size", type=int, default=4, help="samples per question (GRPO group)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=64, help="KV cache blocks of the engine")
    p.add_argument("--standard", action="store_true", help="stock kernels: the KL is not 0")
    p.add_argument("--plot", default=None, metavar="OUT.png", type=plot_file,
                   help="reward and KL per step (matplotlib; checked before the run)")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())

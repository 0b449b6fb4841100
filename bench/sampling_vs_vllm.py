"""Which first tokens splitserve and vLLM sample under min_p with top_p, side by side, against
the kept sets of the two filter orders computed from vLLM's raw top-20 logprobs: vLLM 0.32's
(min-p, then top-p on the mass it left) and the older one (top-p on the whole distribution,
then min-p). Start both servers on the same model first (`make run`, and vLLM as
bench/compare/vllm_peer.py starts it; splitserve at its defaults), then run the command below.
It counts which tokens each server draws, not how fast: there is no timing to compare, and the
prompt repeats on purpose, so later draws meet a warm prefix cache on both servers alike,
which changes no kept set.

    .venv/bin/python bench/sampling_vs_vllm.py --splitserve http://127.0.0.1:8000 \
        --vllm http://127.0.0.1:8300
"""

from __future__ import annotations

import argparse
import collections
import json
import math

import httpx


def top_logprobs(client: httpx.Client, base: str, prompt: str) -> dict[str, float]:
    model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
    body = dict(model=model, prompt=prompt, max_tokens=1, temperature=1.0, logprobs=20)
    reply = client.post(f"{base}/v1/completions", json=body).json()
    return reply["choices"][0]["logprobs"]["top_logprobs"][0]


def kept(probs: list[tuple[float, str]], min_p: float, top_p: float, vllm_order: bool) -> list[str]:
    """The tokens a filter order keeps, from probabilities sorted high to low (the head of the
    distribution: enough while the cuts fall inside it)."""
    floor = min_p * probs[0][0]
    by_min_p = [(p, t) for p, t in probs if p >= floor]
    mass = sum(p for p, _ in by_min_p) if vllm_order else 1.0
    out, ahead = [], 0.0
    for p, token in by_min_p:
        if ahead < top_p * mass:
            out.append(token)
        ahead += p
    return out


def sampled(client: httpx.Client, base: str, prompt: str, min_p: float, top_p: float,
            draws: int) -> collections.Counter:
    model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
    counts: collections.Counter = collections.Counter()
    for seed in range(0, draws, 8):
        body = dict(model=model, prompt=prompt, max_tokens=1, temperature=1.0, min_p=min_p,
                    top_p=top_p, n=8, seed=seed)
        reply = client.post(f"{base}/v1/completions", json=body)
        reply.raise_for_status()
        counts.update(choice["text"] for choice in reply.json()["choices"])
        print(f"\r{base}: {sum(counts.values())}/{draws} draws", end="", flush=True)
    print()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splitserve", default="http://127.0.0.1:8000")
    parser.add_argument("--vllm", default="http://127.0.0.1:8300")
    parser.add_argument("--prompt", default="Here is a random colour:")
    parser.add_argument("--min-p", type=float, default=0.05)
    parser.add_argument("--top-p", type=float, default=0.4)
    parser.add_argument("--draws", type=int, default=240)
    args = parser.parse_args()
    client = httpx.Client(timeout=120)
    head = top_logprobs(client, args.vllm, args.prompt)
    probs = sorted(((math.exp(lp), token) for token, lp in head.items()), reverse=True)
    report = {
        "prompt": args.prompt, "min_p": args.min_p, "top_p": args.top_p,
        "vllm_top": {t: round(p, 4) for p, t in probs[:8]},
        "kept_vllm_order": kept(probs, args.min_p, args.top_p, vllm_order=True),
        "kept_older_order": kept(probs, args.min_p, args.top_p, vllm_order=False),
    }
    for name, base in (("vllm", args.vllm), ("splitserve", args.splitserve)):
        report[name] = dict(sampled(client, base, args.prompt, args.min_p, args.top_p,
                                    args.draws).most_common())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

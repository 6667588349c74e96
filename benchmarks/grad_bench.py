"""A gradient pass against a forward pass (issue 49: a gradient pass at most 3x a forward pass).

Three arms over the same prompt, alternating in one process, torch pinned to --threads; the best of --repeat rounds
of each is kept:

  forward    run_with_cache(prompt, names=NAMES): the research pass as it runs without gradients
  graph      run_with_cache(prompt, names=NAMES, grad=True): the same pass building its autograd graph
  gradient   the graph arm, then torch.autograd.grad of the last position's top logit with respect to every kept
             tensor (one backward pass through the whole model)

The ratio reported is gradient / forward: what a logit's gradient with respect to the residual stream costs beside
the pass that computes the logit.

    python benchmarks/grad_bench.py                      # SmolLM2-135M, 2 threads, every layer's resid_post
    python benchmarks/grad_bench.py -m gemma-3-270m-it --threads 1 --names "*.q"
"""

from __future__ import annotations

import argparse
import time

PROMPT = ("The Eiffel Tower is in the city of Paris, and the Colosseum is in the city of Rome. The capital of "
          "France is")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="model (default: smollm2-135m-instruct)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads, pinned for every arm")
    ap.add_argument("--repeat", type=int, default=5, help="rounds, each running every arm; the best of each is kept")
    ap.add_argument("--names", default="*.resid_post", help="the points kept (and differentiated)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import torch

    import llmtrace  # the public API: a benchmark measures what users run

    torch.set_num_threads(args.threads)
    model = llmtrace.load(args.model, device=args.device, dtype="float32")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def forward() -> float:
        sync()
        t = time.perf_counter()
        model.run_with_cache(args.prompt, names=args.names)
        sync()
        return time.perf_counter() - t

    def graph() -> float:
        sync()
        t = time.perf_counter()
        model.run_with_cache(args.prompt, names=args.names, grad=True)
        sync()
        return time.perf_counter() - t

    def gradient() -> float:
        sync()
        t = time.perf_counter()
        logits, cache = model.run_with_cache(args.prompt, names=args.names, grad=True)
        kept = [cache[n] for n in cache.names() if cache[n].requires_grad]
        torch.autograd.grad(logits[0, -1, int(logits[0, -1].argmax())], kept)
        sync()
        return time.perf_counter() - t

    arms = {"forward": forward, "graph": graph, "gradient": gradient}
    for arm in arms.values():
        arm()  # first calls (allocations, kernels) outside the timing
    best = {name: float("inf") for name in arms}
    for r in range(args.repeat):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))  # no arm always first
        for name in order:
            best[name] = min(best[name], arms[name]())
    T = model.to_tokens(args.prompt).size(1)
    print(f"model {model.loaded.name}, {model.config.n_layers} layers, T={T} tokens, names {args.names!r}, "
          f"{args.threads} threads, {args.device}, best of {args.repeat}")
    for name, seconds in best.items():
        print(f"  {name:<9} {seconds * 1e3:8.1f} ms   {seconds / best['forward']:.2f}x forward")


if __name__ == "__main__":
    main()

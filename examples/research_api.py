"""The researcher's API, worked: the logit lens by hand, a head ablated by hand, a direction's projection removed.

    python examples/research_api.py                          # the default model, smollm2-135m-instruct
    python examples/research_api.py MODEL --prompt "..."     # any model llmtrace runs: registry name, HF dir, .gguf

Each section does by hand, with run_with_cache and run_with_hooks, what a TransformerLens user knows, and checks
itself against llmtrace's own numbers: the last layer's lens against the model's logits, the hand-made ablation
against `llmtrace.Ablate`, the edited stream's projection on the direction against zero. A check that fails stops the
script with its figures. docs/research-api.md walks through it with the real model's output.
"""

import argparse

import torch

import llmtrace


def top(model, logits_row: torch.Tensor, k: int = 3) -> str:
    """The k most likely next tokens of one position's logits (V,), as text with their probabilities."""
    probs = logits_row.float().softmax(-1)
    p, ids = probs.topk(k)
    return "  ".join(f"{model.tokenizer.decode([int(i)])!r} {float(q):.2f}" for q, i in zip(p, ids))


def check(what: str, value: float, limit: float) -> None:
    print(f"  check: {what}: {value:.1e} (at most {limit:g})")
    if not value <= limit:
        raise SystemExit(f"check failed: {what} is {value:.3g}, more than {limit:g}")


def points(model) -> None:
    print(f"points: the first 8 of {len(model.points())}")
    for p in model.points()[:8]:
        print(f"  {p.name:<16} {p.step:<10} ({', '.join(p.axes)}){'  editable' if p.editable else ''}")


def logit_lens(model, prompt: str) -> None:
    """TransformerLens: cache.accumulated_resid(apply_ln=True) @ model.W_U, or model.unembed(model.ln_final(x))."""
    print("\nlogit lens by hand: each layer's resid_post through the final norm and the LM head")
    logits, cache = model.run_with_cache(prompt, names="*.resid_post")  # one (1, T, D) tensor a layer
    head = model.loaded.model.head  # the model's own s8-s9: final norm, then LM head (and a family's soft-cap)
    L = model.config.n_layers
    with torch.no_grad():
        for i in range(L):
            lens = head(cache[f"{i}.resid_post"])  # (1, T, V)
            if i % max(1, L // 6) == 0 or i == L - 1:
                print(f"  layer {i:>2}: {top(model, lens[0, -1])}")
        last = head(cache[f"{L - 1}.resid_post"])
    check("the last layer's lens against the model's own logits", float((last - logits).abs().max()), 1e-4)


def head_ablation(model, prompt: str, layer: int, h: int) -> None:
    """TransformerLens: model.run_with_hooks(tokens, fwd_hooks=[("blocks.L.attn.hook_z", zero_head)])."""
    print(f"\nhead ablation by hand: head {h} of layer {layer} zeroed at {layer}.attn_out")

    def zero_head(x, point):  # x: (B, T, H, Dh), the heads' outputs before Wo
        x = x.clone()
        x[:, :, h] = 0.0
        return x

    plain = model.run_with_hooks(prompt)
    mine = model.run_with_hooks(prompt, hooks=[(f"{layer}.attn_out", zero_head)])
    builtin = model.run_with_hooks(prompt, hooks=[llmtrace.Ablate(layer, head=h)])
    print(f"  plain:   {top(model, plain[0, -1])}")
    print(f"  ablated: {top(model, mine[0, -1])}")
    print(f"  the last position's logits moved by up to {float((mine - plain)[0, -1].abs().max()):.3f}")
    check("the hand-made ablation against llmtrace.Ablate", float((mine - builtin).abs().max()), 1e-5)


def projection_removed(model, prompt: str, layer: int, toward: str, away: str) -> None:
    """TransformerLens: run_with_hooks(tokens, fwd_hooks=[("blocks.L.hook_resid_post", remove)])."""
    print(f"\nprojection removed: the direction ({toward!r} − {away!r}) taken out of {layer}.resid_post")
    name = f"{layer}.resid_post"
    _, a = model.run_with_cache(toward, names=[name])
    _, b = model.run_with_cache(away, names=[name])
    d = a[name][0, -1] - b[name][0, -1]  # (D,): the difference of the two last tokens' streams
    d = d / d.norm()

    def remove(x, point):  # x: (B, T, D); x - (x·d) d at every position
        return x - (x @ d)[..., None] * d

    _, before = model.run_with_cache(prompt, names=[name])
    with model.hooks([(name, remove)]):  # the cache sees the stream as the hook left it
        edited_logits, after = model.run_with_cache(prompt, names=[name])
    plain = model.run_with_hooks(prompt)
    print(f"  |x·d| before: {float((before[name] @ d).abs().max()):.3f}")
    print(f"  plain:  {top(model, plain[0, -1])}")
    print(f"  edited: {top(model, edited_logits[0, -1])}")
    check("|x·d| after the hook", float((after[name] @ d).abs().max()), 1e-3)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--layer", type=int, default=None, help="the layer edited (default: a third of the way in)")
    parser.add_argument("--head", type=int, default=0)
    args = parser.parse_args(argv)
    model = llmtrace.load(args.model, device="cpu", dtype="float32")
    layer = args.layer if args.layer is not None else model.config.n_layers // 3
    print(model)
    points(model)
    logit_lens(model, args.prompt)
    head_ablation(model, args.prompt, layer, args.head)
    projection_removed(model, args.prompt, layer, "I love this", "I hate this")


if __name__ == "__main__":
    main()

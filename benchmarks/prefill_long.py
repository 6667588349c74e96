"""A long prompt's prefill: time and peak memory, llmtrace against HF transformers on the same weights.

llmtrace prefills a long prompt in chunks of `llmtrace.run.generate.PREFILL_CHUNK` tokens through the KV cache, so the
attention scores of a pass are (H, chunk, S) rather than (H, T, T). This measures what that costs and saves on a real
prompt of ~8k tokens (prose repeated to length), each side in a fresh process with torch pinned to `--threads`:

    llmtrace   llmtrace.load, then generate(-n 1, no trace): prefill_s from the generation loop itself
    hf         AutoModelForCausalLM from the same GGUF (float32, transformers' default attention, sdpa), then one
               forward over the prompt with a cache, logits of the last position only

Both sides run a short warm-up pass first (weights paged in, first calls paid), so the time is the prefill's own.
Peak memory is the process's peak resident set size *during the prefill* (Linux: the peak is reset through
/proc/self/clear_refs after the warm-up, read from VmHWM after the prefill), so that HF's heavier GGUF load does not
hide it; the RSS before the prefill is shown beside it.

    python benchmarks/prefill_long.py --threads 2                  # 8,000 tokens
    python benchmarks/prefill_long.py --threads 2 --tokens 4000    # shorter, for a busy machine
    python benchmarks/prefill_long.py --threads 2 --only llmtrace  # one side

Prints one line per side and the ratios (llmtrace / HF): prefill seconds, peak RSS during the prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROSE = ("The history of science is the study of how people came to understand the natural world, from the first "
         "careful observations of the sky and the seasons to the experiments and theories of the modern era. ")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size, to the current RSS


def arm(side: str, gguf: str, n_tokens: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import llmtrace  # the public API: a benchmark measures what users run

    lm = llmtrace.load(gguf, device="cpu", dtype="float32").loaded  # llmtrace's tokenizer gives both sides the same ids
    ids = lm.tokenizer.encode(PROSE * (n_tokens // 30 + 1), add_special_tokens=False)[:n_tokens]
    if side == "hf":
        import transformers

        transformers.logging.set_verbosity_error()
        del lm
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32).eval()
    with torch.inference_mode():  # a short warm-up pass: every weight paged in, first-call costs paid, on both sides
        if side == "hf":
            model(torch.tensor([ids[:8]]))
        else:
            lm.model(torch.tensor([ids[:8]]))
    rss_loaded = _status_kb("VmRSS")
    _reset_peak()
    with torch.inference_mode():
        if side == "hf":
            t = time.perf_counter()
            model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            seconds = time.perf_counter() - t
        else:
            from llmtrace.run.generate import generate
            from llmtrace.run.sampler import Sampler, SamplerConfig

            result = generate(lm, ids, Sampler(SamplerConfig(temperature=0.0), lm.config.vocab_size), 1)
            seconds = result.prefill_s
    return {"side": side, "tokens": len(ids), "prefill_s": seconds, "rss_loaded_mib": rss_loaded / 1024,
            "peak_prefill_mib": _status_kb("VmHWM") / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="a .gguf file (default: the default model's)")
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["llmtrace", "hf"], default=None)
    ap.add_argument("--arm", choices=["llmtrace", "hf"], help=argparse.SUPPRESS)  # the child process's side
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm, args.model, args.tokens, args.threads)))
        return 0
    if args.model is None:
        from llmtrace.registry.resolve import resolve

        args.model = str(resolve(None).path)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    results = {}
    for side in [args.only] if args.only else ["llmtrace", "hf"]:
        out = subprocess.run([sys.executable, __file__, "--arm", side, "-m", args.model, "--tokens", str(args.tokens),
                              "--threads", str(args.threads)], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{side}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        r = results[side] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{side:>8}: {r['tokens']:,} tokens prefilled in {r['prefill_s']:.1f} s "
              f"({r['tokens'] / r['prefill_s']:.0f} tok/s) · RSS before {r['rss_loaded_mib']:,.0f} MiB · "
              f"peak during the prefill {r['peak_prefill_mib']:,.0f} MiB", flush=True)
    if len(results) == 2:
        a, b = results["llmtrace"], results["hf"]
        print(f"llmtrace / HF: prefill time {a['prefill_s'] / b['prefill_s']:.2f}× · peak RSS during the prefill "
              f"{a['peak_prefill_mib'] / b['peak_prefill_mib']:.2f}× · growth over the RSS before "
              f"{(a['peak_prefill_mib'] - a['rss_loaded_mib']) / max(b['peak_prefill_mib'] - b['rss_loaded_mib'], 1):.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())

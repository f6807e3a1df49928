"""Reference numbers, not part of stapo: Hugging Face transformers `generate` (static
batching) on the shape and forced lengths of `stapo bench rollout`, so the engine's
tokens/s can be set beside what a user of transformers gets on the same CPU.

Run it in a throw-away virtualenv (python3 -m venv /tmp/hf && /tmp/hf/bin/pip install
torch transformers numpy):

    /tmp/hf/bin/python docs/bench/hf_rollout.py --responses 64 --batch 16

Shape: the 16.8M model of `stapo bench` (4 layers, hidden 512, 8 heads over 4 KV heads
of 64, intermediate 1536, vocab 8192, tied embeddings), random weights, f32, 128-token
prompts. Lengths: `lognormal:LO:HI` as stapo draws them (LO and HI the 2.5% and 97.5%
quantiles: mu = (ln LO + ln HI) / 2, sigma = (ln HI - ln LO) / 3.92, clamped to
[LO, HI]; numpy's generator, so not the same draws as stapo's, the same distribution).
Static batching as transformers does it: rows in chunks of --batch, each chunk decodes
until its longest response (EOS suppressed: min_new_tokens = max_new_tokens = the
chunk's longest); the useful tokens are each row's own length, and tokens/s counts only
those, as the static policy of `stapo bench rollout` does.
"""
import argparse
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def lengths(n, lo, hi, seed):
    mu, sigma = (np.log(lo) + np.log(hi)) / 2, (np.log(hi) - np.log(lo)) / 3.92
    rng = np.random.default_rng(seed)
    return np.clip(np.round(np.exp(rng.normal(mu, sigma, n))), lo, hi).astype(int)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--responses", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lengths", default="lognormal:100:4000")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    _, lo, hi = a.lengths.split(":")
    lens = lengths(a.responses, int(lo), int(hi), a.seed)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      max_position_embeddings=a.prompt + int(hi) + 8, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    useful, total, secs = 0, 0, 0.0
    for i in range(0, a.responses, a.batch):
        chunk = lens[i:i + a.batch]
        ids = torch.randint(0, cfg.vocab_size, (len(chunk), a.prompt))
        longest = int(chunk.max())
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                           top_k=0, max_new_tokens=longest, min_new_tokens=longest, eos_token_id=None,
                           pad_token_id=0)
        secs += time.perf_counter() - t0
        useful += int(chunk.sum())
        total += longest * len(chunk)
        print(f"chunk {i // a.batch}: {len(chunk)} rows to {longest} tokens, {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"hf generate: {a.responses} responses ({a.lengths}, mean {lens.mean():.0f}), batch {a.batch}: "
          f"{useful} useful of {total} decoded tokens in {secs:.1f} s = {useful / secs:.1f} useful tok/s "
          f"(torch {torch.__version__}, {a.threads} threads)")


if __name__ == "__main__":
    main()

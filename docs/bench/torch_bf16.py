"""Reference numbers, not part of stapo: PyTorch on the CPU in f32 and bf16 beside
`stapo bench generate --dtype bfloat16` and `stapo bench train --dtype bfloat16`.

Run it in a throw-away virtualenv (python3 -m venv /tmp/torchvenv &&
/tmp/torchvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
&& /tmp/torchvenv/bin/pip install transformers):

    OMP_WAIT_POLICY=PASSIVE /tmp/torchvenv/bin/python docs/bench/torch_bf16.py --what generate --dtype bf16
    OMP_WAIT_POLICY=PASSIVE /tmp/torchvenv/bin/python docs/bench/torch_bf16.py --what train --dtype bf16

Shape: the 16.8M model of `stapo bench` (4 layers, hidden 512, 8 heads over 4 KV heads of
64, intermediate 1536, vocab 8192, tied embeddings), random weights. `--shape 0.6b` takes
Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads of 128, intermediate 3072, vocab
151936).

generate: `model.generate` greedy, batch --batch, 16-token prompts, --new tokens (EOS
suppressed); bf16 = the weights in bf16 (`model.to(torch.bfloat16)`), as stapo's bf16
rollout copy. Prints tokens/s (new tokens only).

train: one update step as `stapo bench train` does it (no-grad forward for the old
log-probs, forward, log-softmax, log-prob of the taken token and entropy, clipped-ratio
loss with a mask, backward, gradient clipping, AdamW); bf16 = f32 master weights and
`torch.autocast("cpu", dtype=torch.bfloat16)` around the forwards. Prints s/step.
"""
import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def config(shape):
    if shape == "0.6b":
        return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    return Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)


def generate(model, a):
    ids = torch.randint(0, model.config.vocab_size, (a.batch, 16))
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kw)  # warm-up
        t = time.perf_counter()
        for _ in range(a.reps):
            model.generate(ids, **kw)
        secs = (time.perf_counter() - t) / a.reps
    print(f"torch generate {a.dtype}: batch {a.batch} x {a.new} new: {a.batch * a.new / secs:.0f} tok/s")


def step(model, opt, ids, resp, a):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if a.dtype == "bf16" else torch.autocast("cpu", enabled=False)
    targets = ids[:, -resp:]
    with torch.no_grad(), ctx:
        old = torch.log_softmax(model(ids, logits_to_keep=resp + 1).logits[:, :-1].float(), -1)
        old = old.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with ctx:
        logits = model(ids, logits_to_keep=resp + 1).logits[:, :-1].float()
    lsm = torch.log_softmax(logits, -1)
    logp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    adv = torch.randn(ids.shape[0], 1)
    ratio = (logp - old).exp()
    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv).mean() - 0.0 * entropy.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def train(model, a):
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    resp = a.seq // 2
    step(model, opt, ids, resp, a)  # warm-up
    t = time.perf_counter()
    for _ in range(a.reps):
        step(model, opt, ids, resp, a)
    print(f"torch update {a.dtype}: batch {a.batch} x {a.seq}: {(time.perf_counter() - t) / a.reps:.3f} s/step")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["generate", "train"], default="generate")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
    p.add_argument("--shape", choices=["16.8m", "0.6b"], default="16.8m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config(a.shape)).eval()
    if a.what == "generate":
        if a.dtype == "bf16":
            model = model.to(torch.bfloat16)
        generate(model, a)
    else:
        model.train()
        train(model, a)


if __name__ == "__main__":
    main()

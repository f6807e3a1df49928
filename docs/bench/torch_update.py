"""Reference numbers, not part of stapo: one RL update step in PyTorch f32 on the CPU,
beside `stapo bench train`, with the same phases timed.

Run it in a throw-away virtualenv (python3 -m venv /tmp/torchvenv &&
/tmp/torchvenv/bin/pip install torch transformers):

    OMP_WAIT_POLICY=PASSIVE /tmp/torchvenv/bin/python docs/bench/torch_update.py --shape bundled --batch 512 --seq 48
    OMP_WAIT_POLICY=PASSIVE /tmp/torchvenv/bin/python docs/bench/torch_update.py --shape 16.8m --batch 8 --seq 128

Shapes: `bundled` is models/tiny-qwen3 (4 layers, hidden 192, 4 heads over 2 KV heads of 48,
intermediate 512, vocab 271, tied embeddings; `stapo bench train --hidden 192 --layers 4
--heads 4 --kv-heads 2 --head-dim 48 --intermediate 512 --vocab 271`), `16.8m` the default
shape of `stapo bench` (4 layers, hidden 512, 8 heads over 4 KV heads of 64, intermediate
1536, vocab 8192, tied). Random weights (`Qwen3ForCausalLM`, transformers).

The step is the one `stapo bench train`'s "full update step" times (`train::update` with
one epoch over one mini-batch): a forward with gradient through the decoder, the head
over the response positions only (`logits_to_keep`), log-softmax, log-prob of the taken
token and entropy, the clipped-ratio loss with the old log-probs taken detached from the
same forward (one epoch, one mini-batch: the policy has not moved yet), backward,
gradient clipping to norm 1 and an AdamW step. `--old-forward` adds a separate no-grad
forward for the old log-probs first (what several epochs or mini-batches need).

Prints the mean seconds per step over --reps after one warm-up, and the same phases as
`stapo bench train`'s phase table (wall and process CPU ms per step; CPU over wall says
how many cores a phase kept busy). `--profile` adds torch.profiler's table of the
operators of one step, by total CPU time.
"""
import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

PHASES = ["old-policy forward (no grad)", "forward (decoder layers)", "loss and statistics (head, objective)",
          "backward", "optimizer (clip, AdamW)"]


def config(shape):
    common = dict(tie_word_embeddings=True, rms_norm_eps=1e-6, attention_bias=False)
    if shape == "bundled":
        return Qwen3Config(vocab_size=271, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=48, rope_theta=10000.0,
                           max_position_embeddings=512, **common)
    return Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_theta=1000000.0,
                       max_position_embeddings=40960, **common)


class Clock:
    """Wall and process CPU seconds per phase."""

    def __init__(self):
        self.wall = {p: 0.0 for p in PHASES}
        self.cpu = {p: 0.0 for p in PHASES}
        self.on = False

    def run(self, phase, f):
        w, c = time.perf_counter(), time.process_time()
        r = f()
        if self.on:
            self.wall[phase] += time.perf_counter() - w
            self.cpu[phase] += time.process_time() - c
        return r


def head_stats(model, hidden, targets):
    logits = model.lm_head(hidden).float()
    lsm = torch.log_softmax(logits, -1)
    logp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    return logp, entropy


def step(model, opt, ids, resp, adv, a, clock):
    targets = ids[:, -resp:]
    p = ids.shape[1] - resp
    old = None
    if a.old_forward:
        def old_forward():
            with torch.no_grad():
                h = model.model(ids).last_hidden_state[:, p - 1:-1]
                return head_stats(model, h, targets)[0]
        old = clock.run(PHASES[0], old_forward)
    hidden = clock.run(PHASES[1], lambda: model.model(ids).last_hidden_state[:, p - 1:-1])

    def loss_of():
        logp, entropy = head_stats(model, hidden, targets)
        o = logp.detach() if old is None else old
        ratio = (logp - o).exp()
        return -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv).mean() - 0.0 * entropy.mean()

    loss = clock.run(PHASES[2], loss_of)
    clock.run(PHASES[3], loss.backward)

    def optimize():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    clock.run(PHASES[4], optimize)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["bundled", "16.8m"], default="16.8m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--response", type=int, default=0, help="response tokens (default: half the sequence)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--old-forward", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config(a.shape)).train()
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq))
    resp = a.response or a.seq // 2
    adv = torch.tensor([[-1.0] if i % 2 == 0 else [1.0] for i in range(a.batch)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    clock = Clock()
    step(model, opt, ids, resp, adv, a, clock)  # warm-up
    clock.on = True
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(a.reps):
        step(model, opt, ids, resp, adv, a, clock)
    wall, cpu = (time.perf_counter() - w0) / a.reps, (time.process_time() - c0) / a.reps
    n = sum(x.numel() for x in model.parameters())
    print(f"torch {torch.__version__} f32, {a.threads} threads, {a.shape} shape ({n / 1e6:.2f}M params), "
          f"batch {a.batch} x {a.seq} ({a.seq - resp} prompt + {resp} response)")
    print(f"torch update: {wall:.3f} s/step (mean of {a.reps} after a warm-up)")
    print(f"{'phase':<40} {'wall ms':>9} {'share':>7} {'cpu ms':>9} {'cpu/wall':>8}")
    rows = [(ph, clock.wall[ph] / a.reps, clock.cpu[ph] / a.reps) for ph in PHASES]
    rows.append(("host work between the phases", max(wall - sum(r[1] for r in rows), 0.0),
                 max(cpu - sum(r[2] for r in rows), 0.0)))
    rows.append(("whole update", wall, cpu))
    for name, w, c in rows:
        ratio = f"{c / w:.2f}" if w > 0 else "-"
        print(f"{name:<40} {w * 1e3:>9.1f} {100 * w / wall:>6.1f}% {c * 1e3:>9.1f} {ratio:>8}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, opt, ids, resp, adv, a, Clock())
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()

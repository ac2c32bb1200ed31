"""Run every benchmark once, one after the other, and print one combined markdown table.

    python bench/run_all.py            # the full set (~15 min on 2 idle cores)
    python bench/run_all.py --quick    # smoke run of every script
    python bench/run_all.py --report   # only re-print the table from bench/results/*.json

Every script writes ``bench/results/<name>.json`` (with the load average it ran under); this script
prints the exact commands it ran and a table to paste into the README. Options after ``--`` are passed
to every script (e.g. ``-- --threads 2`` on an idle machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _common as C

SCRIPTS = ("step_time", "mfu", "throughput_vs_trainer", "multi_lora_memory", "large_vocab_memory", "sampler",
           "megatron_vs_ddp", "first_step", "multi_tenant_switch")  # mfu reads step_time's result


def load(name: str, out_dir: Path) -> dict | None:
    path = out_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_text(r: dict) -> str:
    ld = r.get("load", {})
    s, e = ld.get("loadavg_start"), ld.get("loadavg_end")
    if not s:
        return "-"
    share = ld.get("cpu_share")
    return f"{s[0]:.1f}→{e[0]:.1f} (CPU share {share:.2f})" if share is not None else f"{s[0]:.1f}→{e[0]:.1f}"


def yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def combined_table(out_dir: Path) -> str:
    rows = []
    r = load("step_time", out_dir)
    if r:
        m, pr = r["result"], r["result"]["paired_ratio"]
        st = r["settings"]
        rows.append(["(a) step time, ms/step", f"{m['twinkle_ms']['median']:.1f}",
                     f"hand loop {m['hand_ms']['median']:.1f}",
                     f"{pr['median']:.3f} [{pr['p25']:.3f}-{pr['p75']:.3f}]", "≤ 1.03", yes(r["meets_target"]),
                     f"{st['batch_size']}x{st['seq_len']} tokens, {st['pairs']} pairs, {st['threads']} thr",
                     load_text(r)])
        p = r["overhead_probe"]
        rows.append(["(a) fixed overhead, tiny model, ms/step", f"{p['twinkle_ms']['median']:.2f}",
                     f"hand loop {p['hand_ms']['median']:.2f}", f"{p['paired_ratio']['median']:.3f}", "-", "-",
                     f"{p['overhead_ms']:+.2f} ms/step; bookkeeping on bench model "
                     f"{r['bookkeeping_ms']['per_step_total']:.1f} ms "
                     f"({100 * r['bookkeeping_share_of_twinkle_step']:.1f}%)", load_text(r)])
    r = load("throughput_vs_trainer", out_dir)
    if r:
        s, q = r["summary"], r["ratios"]
        tr = s.get("trainer", {}).get("tokens_per_s", {}).get("median")
        ta = s.get("trainer_adamw", {}).get("tokens_per_s", {}).get("median")
        pr = q.get("padded, paired per step: twinkle / trainer")
        rows.append(["(b1) padded SFT, real tokens/s", f"{s['twinkle']['tokens_per_s']['median']:.0f}",
                     f"Trainer {tr:.0f}", f"{q['padded: twinkle / trainer']['median']:.3f}"
                     + (f" (per step {pr['median']:.3f})" if pr else ""), "≥ 1.0", yes(r["meets_targets"]["padded"]),
                     f"Trainer default optim ({r['trainer_optimizers'].get('trainer', {}).get('class')}, fused="
                     f"{r['trainer_optimizers'].get('trainer', {}).get('fused')}); {r['settings']['passes']} passes",
                     load_text(r)])
        if ta:
            rows.append(["(b1') padded, same optimizer impl.", f"{s['twinkle']['tokens_per_s']['median']:.0f}",
                         f"Trainer adamw_torch {ta:.0f}", f"{q['padded: twinkle / trainer_adamw']['median']:.3f} (per "
                         f"step {q['padded, paired per step: twinkle / trainer_adamw']['median']:.3f})", "≥ 1.0",
                         yes(q['padded: twinkle / trainer_adamw']['median'] >= 1.0),
                         f"final weights max diff {r['checks']['final_weights_max_abs_diff'].get('twinkle_vs_trainer_adamw', float('nan')):.1e}",
                         load_text(r)])
        d = r["data"]
        rows.append(["(b2) packed vs Trainer padded, real tokens/s",
                     f"{s['twinkle_packed']['tokens_per_s']['median']:.0f}", f"Trainer {tr:.0f}",
                     f"{q['packed: twinkle_packed / trainer (padded)']['median']:.3f}", "≥ 1.5",
                     yes(r["meets_targets"]["packed"]),
                     f"padding eff. {d['padding_efficiency_padded_batches']:.2f} → packed rows "
                     f"{d['packing_efficiency_packed_rows']:.2f}"
                     + (f"; vs adamw_torch {q['packed: twinkle_packed / trainer_adamw (padded)']['median']:.3f}"
                        if ta else ""), load_text(r)])
    r = load("mfu", out_dir)
    if r:
        res = r["result"]
        rows.append(["(c) MFU", f"{100 * res['mfu_paired']['median']:.1f}%",
                     f"peak {res['peak_matmul_flops']['best'] / 1e9:.1f} GFLOP/s fp32 matmul",
                     f"{res['achieved_flops']['median'] / 1e9:.1f} GFLOP/s achieved", "-", "-",
                     f"{r['flops']['flops_per_token'] / 1e6:.1f} MFLOP/token = 6N + 12·L·d·T; best case "
                     f"{100 * res['mfu_best_case']:.1f}%", load_text(r)])
    r = load("multi_lora_memory", out_dir)
    if r:
        sc, q, n = r["scenarios"], r["ratios"], r["settings"]["tenants"]
        mib = lambda x: f"{x / 2**20:,.1f} MiB"  # noqa: E731
        above = r["max_rss_above_baseline_bytes"]
        rows.append([f"(d) {n} LoRA tenants vs base, tracked", mib(sc["multi_lora"]["tracked_bytes"]),
                     f"base {mib(sc['base']['tracked_bytes'])}", f"{q['multi_lora_over_base_tracked']:.2f}x", "-", "-",
                     f"+{mib(r['extra_tracked_bytes_per_tenant'])}/tenant; model {r['model']['parameters']:,} params",
                     load_text(r)])
        rows.append([f"(d) {n} LoRA tenants vs base, peak RSS", mib(sc["multi_lora"]["max_rss_bytes"]),
                     f"base {mib(sc['base']['max_rss_bytes'])}", f"{q['multi_lora_over_base_max_rss']:.2f}x", "-", "-",
                     f"above import baseline: {mib(above['multi_lora'])} vs {mib(above['base'])} "
                     f"({q['multi_lora_over_base_max_rss_above_baseline']:.2f}x)", load_text(r)])
        rows.append([f"(d) {n} full copies vs multi-LoRA", mib(sc["full_n"]["tracked_bytes"]) + " tracked",
                     f"multi-LoRA {mib(sc['multi_lora']['tracked_bytes'])}",
                     f"{q['full_n_over_multi_lora_tracked']:.1f}x", "-", "-",
                     f"peak RSS {mib(sc['full_n']['max_rss_bytes'])} ({q['full_n_over_multi_lora_max_rss']:.2f}x; "
                     f"{n} processes {q['n_processes_full_1_over_multi_lora_max_rss']:.1f}x)", load_text(r)])
    r = load("large_vocab_memory", out_dir)
    if r:
        c, ratio = r["contenders"], r["peak_ratio_vs_trainer"]
        mib = lambda name: f"{c[name]['peak_above_baseline_mib']:,.0f} MiB"  # noqa: E731
        rows.append([f"(e) peak memory, vocab {r['settings']['vocab_size']:,}, {r['settings']['batch_size']}x"
                     f"{r['settings']['seq_len']} tokens fp32", mib("twinkle"), f"Trainer {mib('trainer')}",
                     f"{ratio['twinkle']:.2f}", "≤ 0.6", yes(r["meets_targets"]["memory"]),
                     f"chunked CE over logits {mib('twinkle_chunked')} ({ratio['twinkle_chunked']:.2f}), plain CE "
                     f"{mib('twinkle_logits')} ({ratio['twinkle_logits']:.2f}), hand loop {mib('hand')} "
                     f"({ratio['hand']:.2f}); loss gap {r['max_first_loss_gap_vs_hand']:.1e}; step time vs hand "
                     f"{r['twinkle_step_time_ratio_vs_hand']:.3f} (≤ 1.05 {yes(r['meets_targets']['step_time'])})",
                     load_text(r)])
    r = load("multi_tenant_switch", out_dir)
    if r:
        bk, bw, st, b = r["bookkeeping_ms"], r["bookkeeping_wall_ms"], r["step_ms"], r["breakdown_ms"]
        rows.append(["(f) multi-tenant bookkeeping, ms per tenant step", f"{bk['median']:.2f}",
                     f"tenant step {st['median']:.0f}", f"{100 * r['bookkeeping_share_of_step']:.2f}% of the step",
                     "≤ 1 ms", yes(r["meets_target"]),
                     f"CPU time (wall {bw['median']:.2f}); {r['settings']['tenants']} tenants switching every step; "
                     f"switch {b['switch_tenant']:.3f} ms", load_text(r)])
    r = load("first_step", out_dir)
    if r:
        res = r["result"]
        cpu = {k: v["median"] for k, v in res["phases_cpu_s"].items()}
        floor = r.get("outside", {}).get("import torch + transformers + AutoTokenizer + Qwen2 modeling")
        split = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items() if k not in ("first_step", "eval_before"))
        rows.append(["(g) time to first step, s", f"{res['before_first_step_s']['median']:.2f}",
                     f"its imports alone {floor['cpu_s']['median']:.2f} s CPU" if floor else "-",
                     f"CPU {res['before_first_step_cpu_s']['median']:.2f} s", "≤ 3 s", yes(r["meets_target"]),
                     f"quickstart, CPU s: {split}; first step {cpu.get('first_step', 0.0):.2f}"
                     + (f"; recipe's eval before training +{r['recipe_as_is']['startup']['phases']['eval_before']:.1f} s"
                        if r.get("recipe_as_is") else ""), load_text(r)])
    r = load("megatron_vs_ddp", out_dir)
    if r:
        res, st = r["result"], r["settings"]
        pr, w = res["paired_ratio"], res["where_time_goes"]
        share = lambda n: f"{100 * w[n]['comm_share']:.0f}% ({100 * w[n]['exposed_comm_share']:.0f}% exposed)"  # noqa: E731
        rows.append(["(h) Megatron TP=2 vs DDP, ms/step", f"{res['megatron_ms']['median']:.1f}",
                     f"DDP {res['ddp_ms']['median']:.1f}", f"{pr['median']:.3f} [{pr['p25']:.3f}-{pr['p75']:.3f}]",
                     f"≤ {r['target_ratio_max']}", yes(r["meets_target"]),
                     f"comm share Megatron {share('megatron')}, DDP {share('ddp')}; {st['batch_size']}x"
                     f"{st['seq_len']} tokens, 2 ranks x {st['threads_per_rank']} thr; max |loss diff| "
                     f"{res['max_abs_loss_diff']:.1e}", load_text(r)])
    r = load("gpu_check", out_dir)  # not run by this script (needs a GPU): shown when its result is there
    if r:
        runs, st = r["runs"], r["settings"]
        tw, tr = runs.get("twinkle", {}), runs.get("trainer", {})
        q = r.get("ratio_tokens_per_s_twinkle_over_trainer")
        mfu = tw.get("mfu")
        rows.append([f"(6) GPU check{' (smoke, CPU)' if st['smoke'] else ''}, tokens/s",
                     f"{tw['tokens_per_s']:,.0f}" if "tokens_per_s" in tw else "-",
                     f"Trainer {tr['tokens_per_s']:,.0f}" if "tokens_per_s" in tr else "-",
                     f"{q:.3f}" if q is not None else "-", "≥ 1.05; MFU ≥ 45%",
                     "-" if mfu is None else yes(bool(r["meets_targets"]["ratio"]) and r["meets_targets"]["mfu"]),
                     f"{st['device_name'] or st['device']}, {st['attn_implementation']}, MFU "
                     + (f"{100 * mfu:.1f}%" if mfu is not None else "null")
                     + (f", peak mem {tw['peak_memory_bytes'] / 2**30:.1f} vs {tr['peak_memory_bytes'] / 2**30:.1f} GiB"
                        if tw.get("peak_memory_bytes") and tr.get("peak_memory_bytes") else ""), load_text(r)])
    r = load("sampler", out_dir)
    if r:
        for mode, res in r["result"].items():
            tps, ratio = res["tokens_per_s"], res["ratio"]
            rows.append([f"(i) RL sampler ({mode}), generated tokens/s", f"{tps['sampler']['median']:.0f}",
                         f"model.generate {tps['generate']['median']:.0f}",
                         f"{ratio['median']:.3f} [{ratio['p25']:.3f}-{ratio['p75']:.3f}]", "≥ 0.95",
                         yes(ratio["median"] >= r["target_ratio_min"]),
                         f"{r['settings']['prompts']} prompts x {r['settings']['new_tokens']} new tokens, "
                         f"{r['model']['parameters'] / 1e6:.1f}M params", load_text(r)])
    headers = ["benchmark", "Twinkle", "reference", "ratio", "target", "met", "notes", "load 1-min (start→end)"]
    return C.markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--report", action="store_true", help="only print the table from existing results")
    parser.add_argument("--only", nargs="*", choices=SCRIPTS, default=None)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- options passed to every script")
    args = parser.parse_args()
    out_dir = Path(args.out_dir) if args.out_dir else C.RESULTS
    extra = [a for a in args.rest if a != "--"]
    commands = []
    if not args.report:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
        for name in args.only or SCRIPTS:
            cmd = [sys.executable, str(C.HERE / f"{name}.py"), *(["--quick"] if args.quick else []),
                   *(["--out-dir", str(out_dir)] if args.out_dir else []), *extra]
            shown = " ".join(["python", os.path.relpath(cmd[1], C.ROOT), *cmd[2:]])
            commands.append(shown)
            print(f"\n$ {shown}   (load {os.getloadavg()[0]:.2f})", flush=True)
            t0 = time.perf_counter()
            done = subprocess.run(cmd, cwd=C.ROOT, env=env, check=False)
            print(f"[{name}: exit {done.returncode}, {time.perf_counter() - t0:.0f} s]", flush=True)
            if done.returncode != 0:
                sys.exit(done.returncode)
    print("\n## Benchmark results\n")
    print(combined_table(out_dir))
    env = C.environment()
    print(f"\n{env['cpu']}, {env['cpu_count']} cores, torch {env['torch']}, transformers {env['transformers']}, "
          f"Python {env['python']}; load = 1-minute load average at the start and end of each script.")
    if commands:
        print("\nCommands (run from the repository root):\n")
        print("```\n" + "\n".join(commands) + "\n```")


if __name__ == "__main__":
    main()

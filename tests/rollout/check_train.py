#!/usr/bin/env python3
"""End-to-end tests of `tiller train` on CPU under mpirun, on the quickstart's toy task.

  check_train.py TILLER MPIRUN SCRATCH CASE

CASE:
  ppo          PPO with GAE (4 ranks: controller, actor+ref, critic, engine): the mean reward rises
               from below 0.3 (first 3 steps) to above 0.7 (last 3); JSONL and TensorBoard agree.
  grpo         GRPO (group_norm, no critic, 3 ranks): the same rise.
  resume       SIGTERM to the controller mid-run: it finishes the step, saves, every rank exits 0;
               --resume continues from that step to the end, with the same dataset cursor.
  engine_dies  the engine process is killed mid-run: the job ends non-zero within the timeout with a
               message naming the failure, and the last checkpoint stays complete.
  rank_oom     a trainer rank runs out of memory mid-run while its ZeRO-3 peer waits in a collective
               with it (its address space is capped with prlimit, a real allocation failure): the job
               ends within seconds, not at the collective's deadline, with the line naming that rank.
  bad_inputs   a malformed JSONL line, a prompt over the limit (policy error), a missing model
               directory and an unknown key: each ends with one clear line, non-zero, no hang.
  remote       GRPO with the remote reward (examples/reward_server/server.py scoring toy_digits, its
               first 2 calls failing UNAVAILABLE): the reward rises; the client retried exactly
               twice; the first steps' rewards equal the built-in rule's. A service that is not
               there, and one slower than reward.remote_timeout_s, end the job with a clear line.
  entropy      the entropy bonus: with algo.entropy_coef large, the policy's entropy after a few
               steps is clearly above the run without it (same seed).
"""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TILLER, MPIRUN, SCRATCH, CASE = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
REPO = Path(__file__).resolve().parents[2]
FIX = SCRATCH / "fixture"
MODEL = FIX / "tiny-qwen2"
PROMPTS = FIX / "prompts.jsonl"


def fail(msg):
    print(f"FAIL ({CASE}): {msg}", file=sys.stderr)
    sys.exit(1)


def fixture():
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_quickstart.py"), str(MODEL), str(PROMPTS)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def command(np_, out, *sets, extra=()):
    args = [MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", str(np_), TILLER, "train", "-c",
            str(REPO / "configs" / "quickstart.yaml"), *extra]
    base = [f"roles.actor.model={MODEL}", f"roles.critic.model={MODEL}", f"data.prompts={PROMPTS}",
            f"run.output_dir={out}", f"checkpoint.dir={out}/checkpoints", "timeouts.collective_s=60",
            "timeouts.generate_s=120", "timeouts.startup_s=120"]
    for s in base + list(sets):
        args += ["--set", s]
    return args


def run(np_, out, *sets, extra=(), timeout=600):
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run(command(np_, out, *sets, extra=extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout


def metrics(out):
    return [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def summary(log):
    for line in reversed(log.splitlines()):
        if line.startswith("{") and '"event"' in line:
            return json.loads(line)
    fail("no summary line in the output:\n" + log[-3000:])


def check_learns(np_, *sets):
    out = SCRATCH / CASE
    code, log = run(np_, out, *sets)
    if code != 0:
        fail(f"exit code {code}:\n{log[-4000:]}")
    rows = metrics(out)
    rewards = [r["reward/mean"] for r in rows]
    if [r["step"] for r in rows] != list(range(1, 31)):
        fail(f"steps in metrics.jsonl: {[r['step'] for r in rows]}")
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"{CASE}: mean reward {first:.3f} (steps 1-3) -> {last:.3f} (steps 28-30)")
    if not (first < 0.3 and last > 0.7):
        fail(f"the reward did not rise clearly: {[round(r, 3) for r in rewards]}")
    s = summary(log)
    if s["event"] != "done" or s["steps"] != 30 or s["weight_version"] != 30:
        fail(f"summary {s}")
    for key in ["kl/mean_per_sample", "entropy", "actor/clip_fraction", "advantages/std", "response_length/mean",
                "throughput/generate_tokens_per_s", "time/generate", "time/train", "time/sync",
                "memory/controller_host_peak_mb", "time/score.actor", "time/score.ref"]:
        if key not in rows[-1]:
            fail(f"metric {key} missing from {sorted(rows[-1])}")
    if "critic/loss" in rows[-1] and CASE == "grpo":
        fail("GRPO reported a critic")
    if CASE == "ppo" and "critic/loss" not in rows[-1]:
        fail("PPO with GAE reported no critic loss")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    if [s for s, _ in tb] != list(range(1, 31)) or any(abs(v - r) > 1e-5 for (_, v), r in zip(tb, rewards)):
        fail(f"TensorBoard's reward/mean differs from the JSONL: {tb[:3]} vs {rewards[:3]}")


def start(np_, out, *sets):
    """Starts a job in a fresh output directory; returns it and the list its output lines go to."""
    shutil.rmtree(out, ignore_errors=True)
    return subprocess.Popen(command(np_, out, *sets), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), []


def wait_for(proc, pattern, timeout, lines):
    """Reads proc's output until a line matches; returns the match."""
    end = time.time() + timeout
    rx = re.compile(pattern)
    while time.time() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = rx.search(line)
        if m:
            return m
    fail(f"no line matching {pattern!r}:\n{''.join(lines)[-3000:]}")


def finish(proc, lines, timeout):
    try:
        rest, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        fail("the job did not end (a hang):\n" + "".join(lines)[-3000:])
    lines.append(rest)
    return proc.returncode, "".join(lines)


def check_resume():
    out = SCRATCH / "resume"
    sets = ["train.num_steps=12", "checkpoint.every_steps=4"]
    proc, lines = start(4, out, *sets)
    pid = int(wait_for(proc, r"controller pid (\d+)", 120, lines).group(1))
    wait_for(proc, r"step 5/12", 300, lines)
    os.kill(pid, signal.SIGTERM)
    code, log = finish(proc, lines, 300)
    s = summary(log)
    if code != 0 or s["event"] != "stopped":
        fail(f"after SIGTERM: exit code {code}, summary {s}:\n{log[-3000:]}")
    stopped = s["steps"]
    if not (5 <= stopped < 12):
        fail(f"stopped after step {stopped}")
    ckpt = out / "checkpoints" / f"step_{stopped:06d}"
    if not (ckpt / "controller.json").exists() or not (ckpt / "actor" / "meta.json").exists() \
            or not (ckpt / "critic" / "meta.json").exists():
        fail(f"{ckpt} is not a complete checkpoint: {sorted(p.name for p in ckpt.iterdir())}")
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    if len(kept) > 2:
        fail(f"checkpoint.keep_last is 2, found {kept}")
    state = json.loads((ckpt / "controller.json").read_text())
    before = metrics(out)
    p = subprocess.run(command(4, out, *sets, extra=["--resume"]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600)
    if p.returncode != 0:
        fail(f"--resume: exit code {p.returncode}:\n{p.stdout[-3000:]}")
    s2 = summary(p.stdout)
    if s2["event"] != "done" or s2["steps"] != 12 or s2["weight_version"] != 12:
        fail(f"--resume summary {s2}")
    if f"resumed from {ckpt}" not in p.stdout:
        fail("the log does not say where it resumed from")
    after = metrics(out)[len(before):]
    if [r["step"] for r in after] != list(range(stopped + 1, 13)):
        fail(f"steps after resuming: {[r['step'] for r in after]}")
    if state["dataset"]["position"] != (stopped * 16) % 256:
        fail(f"dataset cursor {state['dataset']} after {stopped} steps of 16 prompts")
    print(f"resume: stopped cleanly after step {stopped}, resumed to step 12")


def check_engine_dies():
    out = SCRATCH / "engine_dies"
    proc, lines = start(4, out, "train.num_steps=200", "checkpoint.every_steps=2", "timeouts.generate_s=60",
                        "timeouts.rpc_s=20")
    pid = int(wait_for(proc, r"engine 0 serving on \S+ \(\d+ KV blocks, pid (\d+)\)", 120, lines).group(1))
    wait_for(proc, r"checkpoint: step 4 saved", 300, lines)
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    code, log = finish(proc, lines, 240)
    if code == 0:
        fail("the job exited 0 although its engine died")
    if not re.search(r"engine 0 \(\S+\)|exited on signal 9|rank 3", log):
        fail("no message names the dead engine:\n" + log[-3000:])
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    complete = [c for c in ckpts if (c / "controller.json").exists()]
    if not complete or not (complete[-1] / "actor" / "meta.json").exists():
        fail(f"no complete checkpoint left: {[c.name for c in ckpts]}")
    print(f"engine_dies: the job ended with code {code} after {time.time() - t0:.1f} s; "
          f"last checkpoint {complete[-1].name} intact")


def world_rank_pid(rank, marker):
    """The pid of the `tiller train` process of MPI world rank `rank` whose command line has `marker`."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"tiller") and marker.encode() in b" ".join(cmd) \
                and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(d.name)
    fail(f"no tiller process of world rank {rank} with {marker!r} in its command line")


def check_rank_oom():
    out = SCRATCH / "rank_oom"
    # 5 ranks: controller, actor (ZeRO-3 over ranks 1-2, the reference colocated), critic, engine.
    # A long collective deadline: a job that waited for it instead of ending would show as a hang.
    proc, lines = start(5, out, "roles.actor.gpus=2", "train.num_steps=200", "timeouts.collective_s=600",
                        "checkpoint.dir=")
    wait_for(proc, r"step 3/200", 300, lines)
    pid = world_rank_pid(1, str(out))
    size_kb = next(int(l.split()[1]) for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if l.startswith("VmSize:"))
    # No new mappings from here: the next large allocation of actor rank 1 fails.
    resource.prlimit(pid, resource.RLIMIT_AS, (size_kb * 1024, resource.RLIM_INFINITY))
    t0 = time.time()
    code, log = finish(proc, lines, 120)
    took = time.time() - t0
    if code == 0:
        fail("the job exited 0 although actor rank 1 ran out of memory:\n" + log[-3000:])
    if not re.search(r"tiller: error: rank 1: .*(alloc|memory)", log):
        fail("no line names rank 1 and its allocation failure:\n" + log[-3000:])
    if took > 60:
        fail(f"the job took {took:.0f} s to end after rank 1 failed (the collective deadline is 600 s)")
    print(f"rank_oom: the job ended with code {code} {took:.1f} s after rank 1's address space was capped: "
          + re.search(r"tiller: error: rank 1: .*", log).group(0)[:200])


def check_bad_inputs():
    bad = SCRATCH / "bad"
    shutil.rmtree(bad, ignore_errors=True)
    bad.mkdir(parents=True)
    lines = PROMPTS.read_text().splitlines()
    (bad / "malformed.jsonl").write_text("\n".join(lines[:5] + ['{"input": "unterminated'] + lines[5:10]) + "\n")
    (bad / "long.jsonl").write_text("\n".join(lines[:3] + [json.dumps({"input": "digits " * 200})]) + "\n")
    (bad / "unknown.yaml").write_text((REPO / "configs" / "quickstart.yaml").read_text()
                                      .replace("  kl_coef: 0.001", "  kl_coeff: 0.001"))
    cases = [
        ("malformed JSONL", [f"data.prompts={bad}/malformed.jsonl"], None, r"malformed\.jsonl:6: "),
        ("prompt over the limit", [f"data.prompts={bad}/long.jsonl", "data.long_prompt_policy=error"], None,
         r"long\.jsonl:4: .*(longer|over|exceeds).*max_prompt_tokens"),
        ("missing model", [f"roles.critic.model={bad}/nope"], None, r"nope"),
        ("unknown key", [], bad / "unknown.yaml", r"algo\.kl_coeff.*did you mean.*algo\.kl_coef"),
    ]
    for name, sets, cfg, pattern in cases:
        args = command(4, bad / "out", *sets)
        if cfg:
            args[args.index(str(REPO / "configs" / "quickstart.yaml"))] = str(cfg)
        expect_error(f"bad input '{name}'", args, pattern)


GRPO = ["algo.advantage_estimator=group_norm", "roles.critic.enabled=false", "algo.kl_in_reward=false",
        "algo.kl_estimator=k3"]


def start_reward_server(name, *flags):
    port_file = SCRATCH / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log = open(SCRATCH / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "reward_server" / "server.py"), "--host",
                             "127.0.0.1", "--port", "0", "--task", "toy_digits", "--port-file", str(port_file),
                             *flags], stdout=log, stderr=subprocess.STDOUT, text=True)
    end = time.time() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.time() > end:
            fail(f"the reward server did not start:\n{(SCRATCH / f'{name}.log').read_text()}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def stop_reward_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def expect_error(name, args, pattern, timeout=240):
    t0 = time.time()
    try:
        p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        fail(f"{name}: the job hung")
    errors = [l for l in p.stdout.splitlines() if l.startswith("tiller: error:")]
    if p.returncode == 0 or not errors or not any(re.search(pattern, l) for l in errors):
        fail(f"{name}: exit code {p.returncode}, error lines {errors}, expected /{pattern}/:\n{p.stdout[-3000:]}")
    print(f"{name}: exit {p.returncode} in {time.time() - t0:.1f} s: {errors[0][:200]}")


def check_remote():
    server, address = start_reward_server("remote", "--fail-first", "2")
    remote = ["reward.type=remote", f"reward.remote_address={address}", "reward.remote_batch_size=8",
              "reward.remote_concurrency=3", "reward.remote_retries=3"]
    try:
        check_learns(3, *GRPO, *remote)
    finally:
        stop_reward_server(server)
    rows = metrics(SCRATCH / CASE)
    retries = sum(r["reward/remote_retries"] for r in rows)
    calls = sum(r["reward/remote_calls"] for r in rows)
    per_step = 16 * 4 // 8  # rollout.batch_size x n_samples / remote_batch_size, from configs/quickstart.yaml
    if retries != 2 or calls < 30 * per_step:
        fail(f"remote calls {calls}, retries {retries}: expected 2 retries and at least {30 * per_step} calls")
    print(f"remote: {calls} Score calls, {retries} retries")
    # The same 3-step job with the built-in rule gives the same rewards: the same samples (same
    # seed), and every score lands on its own sample (else steps 2-3 train differently).
    server, address = start_reward_server("remote_again")
    try:
        code, log = run(3, SCRATCH / "remote_3", *GRPO, "train.num_steps=3", *remote[:1],
                        f"reward.remote_address={address}", *remote[2:])
    finally:
        stop_reward_server(server)
    if code != 0:
        fail(f"3-step remote run: exit code {code}:\n{log[-3000:]}")
    code, log = run(3, SCRATCH / "remote_rule", *GRPO, "train.num_steps=3")
    if code != 0:
        fail(f"rule run: exit code {code}:\n{log[-3000:]}")
    want = [r["reward/mean"] for r in metrics(SCRATCH / "remote_rule")]
    got = [r["reward/mean"] for r in metrics(SCRATCH / "remote_3")]
    if any(abs(a - b) > 1e-6 for a, b in zip(got, want)):
        fail(f"remote rewards {got} differ from the rule's {want}")
    print(f"remote: steps 1-3 rewards {[round(x, 4) for x in got]} equal the built-in rule's")

    # No service at the address: the job fails at start, naming it.
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sk.getsockname()[1]}"
    expect_error("no reward service", command(3, SCRATCH / "remote_dead", *GRPO, "reward.type=remote",
                                              f"reward.remote_address={dead}", "reward.remote_retries=1"),
                 re.escape(dead) + r".*Health failed.*UNAVAILABLE")
    # A service slower than the deadline: retried, then the job ends naming the timeout.
    slow, slow_address = start_reward_server("remote_slow", "--delay", "5")
    try:
        expect_error("slow reward service",
                     command(3, SCRATCH / "remote_slow", *GRPO, "reward.type=remote",
                             f"reward.remote_address={slow_address}", "reward.remote_timeout_s=0.5",
                             "reward.remote_retries=1"),
                     r"Score for step 1 .*failed after 2 attempt\(s\).*DEADLINE_EXCEEDED.*remote_timeout_s")
    finally:
        stop_reward_server(slow)


def check_entropy():
    sets = [*GRPO, "train.num_steps=6"]
    entropies = {}
    for coef in ["0", "5"]:
        out = SCRATCH / f"entropy_{coef}"
        code, log = run(3, out, *sets, f"algo.entropy_coef={coef}")
        if code != 0:
            fail(f"entropy_coef={coef}: exit code {code}:\n{log[-3000:]}")
        entropies[coef] = [r["entropy"] for r in metrics(out)]
    base, bonus = entropies["0"], entropies["5"]
    print(f"entropy: steps 1-6 {[round(e, 4) for e in base]} without the bonus, {[round(e, 4) for e in bonus]} "
          "with algo.entropy_coef=5")
    if abs(base[0] - bonus[0]) > 1e-5:
        fail(f"step 1 (before any update) differs: {base[0]} vs {bonus[0]}")
    # Learning the toy task lowers the entropy; the bonus must push it the other way.
    if not (base[-1] < base[0] and bonus[-1] > bonus[0]):
        fail(f"the entropy bonus did not raise the entropy: {base} vs {bonus}")


fixture()
if CASE == "ppo":
    check_learns(4)
elif CASE == "grpo":
    check_learns(3, *GRPO)
elif CASE == "resume":
    check_resume()
elif CASE == "engine_dies":
    check_engine_dies()
elif CASE == "rank_oom":
    check_rank_oom()
elif CASE == "bad_inputs":
    check_bad_inputs()
elif CASE == "remote":
    check_remote()
elif CASE == "entropy":
    check_entropy()
else:
    fail("unknown case")

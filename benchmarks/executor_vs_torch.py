"""Our executor vs ``torch.distributed.pipelining`` on the same model, partition,
microbatches and schedule, on 4 gloo processes, alternating step by step in one run.

    python benchmarks/executor_vs_torch.py [--nproc 4] [--steps 30] [--dim 128] [--layers 6]
    mpipe-run --nproc 4 benchmarks/executor_vs_torch.py ...   (the same)

Schedules: 1F1B (torch ``Schedule1F1B``, one ``PipelineStage`` per rank) and interleaved
1F1B (torch ``ScheduleInterleaved1F1B``, two looped stages per rank) against our
``1f1b``/``interleaved-1f1b`` terms, lowered, verified and run by ``PipelineExecutor``.
The model is the tiny MLLM of ``examples/train_tiny_mllm.py`` cut by ``split_sequential``
into the same stages for both, stage 0 holding the vision encoder and the first body
slice (so both run exactly the same modules; our plan is the plain family term, no cut
segment). Both compute the same gradients (checked once, printed as the largest
difference). A step is timed on rank 0
between two barriers (forward, backward, gradients; no optimizer), after 3 warm-up steps
(torch infers shapes on its first step). Prints the median step time of each and the
ratio ours / torch per schedule (target <= 1.0): ``ratio`` is the ratio of the medians,
``paired`` the median of the per-round ratios (robust to load drifting during the run),
``cpu ms`` the CPU time of one step summed over all ranks (all threads), ``loop ms`` the
part of it spent by gloo's event-loop threads (``gloo_tcp_loop``, read from
``/proc/self/task``; ``-`` where there is no ``/proc``).

After that run, a second one on 2 ranks with a tiny model (dim 8, 1F1B; overhead-bound)
prints ``overhead_us_per_op ours=X torch=Y``: the median step time over the ops one rank
runs (our plan's ops per rank, the same schedule for both), ``X`` the worse of our default
and ``overlap_comms=False`` modes (``--overhead-steps 0`` skips it).

Contenders: ``ours`` (the default executor: every op posted in plan order, a receive
waited for when its value is first used, sends completed in the background),
``ours-strict`` (``overlap_comms=False``: wait right after each comm op) and
``ours-grouped`` (the plan with adjacent comm ops posted as groups,
``group_adjacent_comms``, re-verified).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per contender")
    ap.add_argument("--microbatches", type=int, default=None, help="default: 2 x ranks")
    ap.add_argument("--rows", type=int, default=None, help="batch rows; default 4 x m")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-1f1b"])
    ap.add_argument("--no-check-messages", action="store_true",
                    help="send bare tensors (no self-describing trailer)")
    ap.add_argument("--overhead-steps", type=int, default=200,
                    help="timed steps of the per-op overhead run (0: skip it)")
    ap.add_argument("--overhead-line", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


OVERHEAD_RUN = ["--nproc", "2", "--dim", "8", "--schedules", "1f1b"]  # tiny: overhead-bound


def loop_cpu_seconds() -> float:
    """CPU seconds used so far by this process's gloo event-loop threads (NaN without
    ``/proc``)."""
    total, tasks = 0, "/proc/self/task"
    if not os.path.isdir(tasks):
        return float("nan")
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != "gloo_tcp_loop":
                    continue
            with open(f"{tasks}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])  # nanoseconds on the CPU
        except OSError:
            continue
    return total / 1e9


def main(argv=None) -> int:
    args = parse(argv)
    if "RANK" in os.environ:
        return rank_main(args)
    from mpipe_verified.executor.launch import launch  # launch ourselves as N ranks
    argv = sys.argv[1:] if argv is None else argv
    me = [sys.executable, os.path.abspath(__file__)]
    code = launch(args.nproc, me + argv, "gloo")
    if code or not args.overhead_steps or args.overhead_line:
        return code
    return launch(2, me + argv + OVERHEAD_RUN + ["--steps", str(args.overhead_steps),
                                                 "--overhead-line"], "gloo")


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    import train_tiny_mllm as tiny
    from mpipe_verified.algebra import family
    from mpipe_verified.executor import (Batch, PipelineExecutor, certify,
                                         group_adjacent_comms, infer_payload_shapes,
                                         init_distributed, split_sequential,
                                         with_payload_shapes)
    from mpipe_verified.lower import lower

    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    m = args.microbatches or 2 * world
    rows = args.rows or 4 * m

    class First(nn.Module):
        def __init__(self, encoder, stage):
            super().__init__()
            self.encoder, self.stage = encoder, stage

        def forward(self, images, tokens):
            return self.stage(self.encoder(images), tokens)

    results = []
    for schedule in args.schedules:
        derived = family(schedule, world, m).derive()
        num_stages = derived.placement.num_stages
        layers = max(args.layers, num_stages - 2)

        def model():
            """The same partition for both: stage 0 is the encoder plus the first slice."""
            encoder, full = tiny.build_model(layers, args.dim)
            out = list(split_sequential(full, num_stages))
            out[0] = First(encoder, out[0])
            return out

        stages, t_stages = model(), model()  # same weights, one copy each
        data = tiny.make_batch(0, rows)
        batch = Batch(body=(data.segments["vision"], data.body), target=data.target)
        plan = lower(derived)
        plan = with_payload_shapes(plan, infer_payload_shapes(stages, batch, m))
        mine = plan.placement.stages_of(rank)
        certificate = certify(plan)
        grouped = group_adjacent_comms(plan)

        def executor(p, **options):
            return PipelineExecutor(p, certify(p) if p is not plan else certificate,
                                    stages=stages, loss_fn=tiny.loss_fn,
                                    check_messages=not args.no_check_messages, **options)

        ours = {"ours": executor(plan),
                "ours-strict": executor(plan, overlap_comms=False),
                "ours-grouped": executor(grouped)}
        # static shapes for torch (its dynamic inference exchanges pickled metadata)
        sample = batch.split(m)[0]
        ins, outs, x = [], [], sample.body
        with torch.no_grad():
            for s in range(num_stages):
                y = t_stages[s](*x)
                ins.append(tuple(t.detach().requires_grad_(s > 0 and t.is_floating_point())
                                 for t in x))
                outs.append(y.detach().requires_grad_(True))
                x = (y,)
        pipe_stages = [PipelineStage(t_stages[s], s, num_stages, device, input_args=ins[s],
                                     output_args=outs[s]) for s in mine]
        if schedule == "1f1b":
            sched = Schedule1F1B(pipe_stages[0], m, loss_fn=tiny.loss_fn)
        else:
            sched = ScheduleInterleaved1F1B(pipe_stages, m, loss_fn=tiny.loss_fn)
        t_modules = [t_stages[s] for s in mine]

        def run_ours(ex):
            ex.zero_grad()
            ex.run(batch, broadcast_loss=False)

        def run_torch():
            for mod in t_modules:
                mod.zero_grad(set_to_none=True)
            kwargs = {}
            if num_stages - 1 in mine:
                kwargs["target"] = batch.target
            if 0 in mine:
                sched.step(*batch.body, **kwargs)
            else:
                sched.step(**kwargs)

        run_torch()
        diff = 0.0
        for ex in ours.values():
            run_ours(ex)
            for s in mine:
                for p, q in zip(stages[s].parameters(), t_stages[s].parameters()):
                    diff = max(diff, (p.grad - q.grad).abs().max().item())
        worst = torch.tensor([diff])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)

        contenders = [("torch", run_torch)] + [(name, (lambda ex=ex: run_ours(ex)))
                                               for name, ex in ours.items()]
        times = {name: [] for name, _ in contenders}
        cpu = {name: 0.0 for name, _ in contenders}
        loop = {name: 0.0 for name, _ in contenders}
        for i in range(3 + args.steps):
            k = i % len(contenders)  # rotate who goes first
            for name, fn in contenders[k:] + contenders[:k]:
                dist.barrier()
                g = loop_cpu_seconds()
                t, c = time.perf_counter(), time.process_time()
                fn()
                c, t = time.process_time() - c, time.perf_counter() - t
                g = loop_cpu_seconds() - g
                dist.barrier()
                if i >= 3:
                    times[name].append(t)
                    cpu[name] += c
                    loop[name] += g
        # CPU seconds per step, summed over ranks (all threads of each process)
        cpu_all = torch.tensor([[cpu[name] / args.steps, loop[name] / args.steps]
                                for name, _ in contenders], dtype=torch.float64)
        dist.all_reduce(cpu_all)
        cpu = {name: cpu_all[i].tolist() for i, (name, _) in enumerate(contenders)}
        results.append((schedule, num_stages, plan.num_ops, times, worst.item(), cpu))

    if rank == 0:
        print(f"{world} gloo ranks, {m} microbatches, {rows} rows, dim {args.dim}, "
              f"{args.steps} timed steps per contender (rotating order), messages "
              f"{'bare' if args.no_check_messages else 'checked'}")
        print(f"{'schedule':17} {'contender':13} {'median ms':>9} {'ratio':>6} "
              f"{'paired':>6} {'cpu ms':>7} {'loop ms':>7}")
        for schedule, n, ops, times, d, cpu in results:
            base = statistics.median(times["torch"])
            for name, ts in times.items():
                med = statistics.median(ts)
                paired = statistics.median(a / b for a, b in zip(ts, times["torch"]))
                total, in_loop = cpu[name]
                print(f"{schedule:17} {name:13} {med * 1e3:9.2f} {med / base:6.2f} "
                      f"{paired:6.2f} {total * 1e3:7.1f} "
                      f"{'-' if in_loop != in_loop else f'{in_loop * 1e3:.1f}':>7}")
            print(f"{schedule:17} ({n} stages, {ops} ops per step in our plan; largest "
                  f"|grad ours - grad torch| {d:.1e})")
            if args.overhead_line:  # wall per op: median step over the ops of one rank
                per_op = {k: statistics.median(ts) / (ops / world) * 1e6
                          for k, ts in times.items()}
                print(f"overhead_us_per_op ours={max(per_op['ours'], per_op['ours-strict']):.0f}"
                      f" torch={per_op['torch']:.0f} (dim {args.dim}, {world} ranks, {schedule};"
                      f" default {per_op['ours']:.0f}, overlap_comms=False "
                      f"{per_op['ours-strict']:.0f})")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``--dry-run`` of an asynchronous run: the processes, what flows between them, and their layouts.

The trainer's execution plan is printed and drawn by :mod:`realflow.system.plan_view`
like any other; this adds the rollout side (generation servers, rollout controller,
rollout workers) as text and as a PNG of processes and flows.
"""
from __future__ import annotations

import pathlib

from realflow.api.experiment import ExperimentSetup

__all__ = ["describe_rollout", "draw_processes"]


_WEIGHT_PATHS = {"memory": "shared memory on the writer's host, torch.distributed broadcast to other hosts",
                 "broadcast": "torch.distributed broadcast (gloo weight group)",
                 "disk": "HF checkpoint on disk"}


def describe_rollout(setup: ExperimentSetup) -> str:
    r = setup.rollout
    assert r is not None
    lines = [
        "rollout side (asynchronous PPO):",
        f"  gen_server/0..{r.n_servers - 1}: {r.backend} backend, tp={r.server_tp}, "
        f"{r.max_running_requests} KV slots each, model {r.model_path}",
        f"  rollout_controller: admits while admitted - failed < (version + {r.max_head_offpolicyness} + 1) "
        f"* {r.train_batch_size}; routes by outstanding tokens; weight rounds pause({r.interrupt_mode}) -> "
        f"update ({r.weight_sync}) -> continue",
        f"  rollout_worker/0..{r.n_rollout_workers - 1}: agent '{r.agent}' {r.agent_args}, "
        f"{r.max_concurrent_rollouts} rollouts in flight each, rewards in {r.reward_processes} process(es), "
        f"timeout {r.reward_timeout_s:g}s",
        f"  trainer: master + model_worker/0..{setup.n_workers - 1}; a step takes {r.train_batch_size} rollouts, "
        "oldest first, under the staleness rule",
        "flows:",
        "  rollout_worker -> rollout_controller: HTTP /admit, /generate, /done (bearer token)",
        "  rollout_controller -> gen_server: HTTP /generate, /pause_generation, /update_weights_*, "
        "/continue_generation",
        "  rollout_worker -> model_worker inbox: trajectories (signed ZMQ, msgpack + tensor frames)",
        "  master <-> rollout_controller: counts, update_weights (signed ZMQ RPC)",
        "  actor home workers -> gen_server: weights (" + _WEIGHT_PATHS[r.weight_sync] + ")",
    ]
    return "\n".join(lines)


def draw_processes(setup: ExperimentSetup, path: str | pathlib.Path) -> pathlib.Path:
    """A PNG with one box per process and one arrow per flow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = setup.rollout
    assert r is not None
    path = pathlib.Path(path)
    fig, ax = plt.subplots(figsize=(11, 6))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 6)
    ax.axis("off")
    boxes = {
        "rollout workers": (1.5, 4.8, f"rollout_worker x{r.n_rollout_workers}\nagent '{r.agent}'", "#cfe8ff"),
        "controller": (5.5, 4.8, f"rollout_controller\neta={r.max_head_offpolicyness}, B={r.train_batch_size}",
                       "#ffe7b3"),
        "servers": (9.5, 4.8, f"gen_server x{r.n_servers}\n{r.backend}, tp={r.server_tp}", "#d8f5d0"),
        "master": (8.0, 1.2, "master\n(staleness-aware batch selection)", "#eeeeee"),
        "workers": (2.0, 1.2, f"model_worker x{setup.n_workers}\ninbox, actor_inf, actor_train\n"
                              f"layout {setup.allocation}", "#f3d6f5"),
    }
    for x, y, text, color in boxes.values():
        ax.text(x, y, text, ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round,pad=0.5", fc=color, ec="#555555"))

    def arrow(a: str, b: str, label: str, bend: float = 0.0) -> None:
        (x0, y0, *_), (x1, y1, *_) = boxes[a], boxes[b]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(
            arrowstyle="->", lw=1.3, color="#333333", shrinkA=38, shrinkB=38, connectionstyle=f"arc3,rad={bend}"))
        # an arc3 curve's midpoint is offset from the chord's by rad/2 of its length, perpendicular to it
        mx, my = (x0 + x1) / 2 + bend * (y1 - y0) / 2, (y0 + y1) / 2 - bend * (x1 - x0) / 2
        ax.text(mx, my, label, ha="center", va="center", fontsize=7.5, bbox=dict(fc="white", ec="none", alpha=0.8))

    arrow("rollout workers", "controller", "/admit /generate /done")
    arrow("controller", "servers", "route, pause/update/continue")
    arrow("rollout workers", "workers", "trajectories\n(signed ZMQ)")
    arrow("master", "controller", "counts, update_weights")
    short = {"memory": "shm / broadcast", "broadcast": "gloo broadcast", "disk": "disk"}[r.weight_sync]
    arrow("workers", "servers", f"weights ({short})", bend=-0.25)
    arrow("master", "workers", "take, actor_inf, actor_train")
    ax.set_title(f"{setup.experiment_name}/{setup.trial_name}: processes and flows", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path

"""A reward plugin for the code RL test (loaded with ``--import code_audit``).

``code-tests-audited`` is the ``code-tests`` reward unchanged, plus one JSON line per scored
response appended to the file named by ``$REALFLOW_CODE_AUDIT``: the reward, the response,
the row's test cases, the process it ran in and whether the sandbox was usable there
(``code-tests`` refuses to run without it unless ``allow_unsandboxed``). The test reads the
file to show that every training reward came from running the program in the sandbox.
"""
from __future__ import annotations

import json
import os

from mfc.code_reward import code_tests_reward
from realflow.api.reward import register_reward
from realflow.base.sandbox import sandbox_status


@register_reward("code-tests-audited")
def audited_code_reward(sample, **args) -> float:
    reward = code_tests_reward(sample, **args)
    path = os.environ.get("REALFLOW_CODE_AUDIT")
    if path:
        line = json.dumps({"id": sample.id, "reward": reward, "response": sample.response, "answer": sample.answer,
                           "pid": os.getpid(), "sandbox_problem": sandbox_status(), "args": args,
                           "failures": sample.meta.get("code_failures", [])})
        with open(path, "a") as f:  # one short line per write: appends from concurrent processes stay whole
            f.write(line + "\n")
    return reward

"""A tool-using agent: multiplication with a calculator called through OpenAI tool calls.

Run it (CPU: a small SFT start on generated demonstrations, then asynchronous GRPO)::

    python -m realflow.apps.main_async_ppo experiment=agent-calculator --import examples.agents.calculator

Products of two 2-digit numbers are beyond a tiny model's mental arithmetic,
but copying a tool's result is not. The SFT start saw both habits: answering directly
(``#### 9716``, usually wrong once it has to do it itself) and calling the calculator
(``<tool_call>{"name": "calculator", ...}</tool_call>``, then copying the result). RL
with a correct-answer reward teaches it to reach for the tool. Each completion is
its own sample (``export=completion``); the tool call shares the final reward,
discounted by ``turn_discount`` per turn.
"""
from __future__ import annotations

import ast
import json
import operator
import random
from dataclasses import dataclass, field
from typing import Any

from examples.agents.math_retry import final_answer
from examples.own_start import OwnStartMixin
from experiments.async_ppo_math import AsyncGRPOMathConfig, AsyncRolloutConfig
from experiments.ppo_math import PPOHyperConfig, RLDataConfig
from realflow.api.agent_function import openai_client, register_agent_function
from realflow.api.experiment import OptimizerConfig, register_experiment

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}
# Tool markup as whole tokens, as in Qwen's vocabulary (a turn then reads the same whether the
# model generated it or the chat template wrote it), and -- a concession to a 64-wide model that
# has seen no JSON before -- the call's fixed JSON around the expression as one token each.
MARKUP = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
          '{"name": "calculator", "arguments": {"expression": "', '"}}')
DATA_VERSION = 3


def calculate(expression: Any) -> str:
    """The tool: evaluates + - * / on numbers only (an AST walk; nothing is executed)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / are allowed")
    try:
        if not isinstance(expression, str) or len(expression) > 64:
            raise ValueError("expected a short expression string")
        v = ev(ast.parse(expression, mode="eval").body)
        return str(int(v)) if float(v).is_integer() else f"{v:.6g}"
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"


@register_agent_function("calculator")
async def run_agent_return_reward(data: dict[str, Any]) -> float:
    messages: list[dict[str, Any]] = [{"role": "user", "content": data["prompt"]}]
    client = openai_client(data)
    for _ in range(3):
        reply = await client.chat.completions.create(model=data["model"], messages=messages, tools=TOOLS,
                                                     max_tokens=40, temperature=1.0)
        msg = reply.choices[0].message
        if not msg.tool_calls:
            return float(final_answer(msg.content) == str(data["answer"]).strip())
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            try:
                expr = json.loads(call.function.arguments).get("expression")
            except (ValueError, AttributeError):
                expr = None
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expr)})
    return 0.0


# ---------------------------------------------------------------- generated data and the SFT start

def _call_text(expr: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "</tool_call>"


def make_rows(n: int, seed: int, tool_share: float) -> tuple[list[dict], list[dict]]:
    """(SFT rows, RL rows): ``n`` problems; a ``tool_share`` of the SFT demonstrations use the tool."""
    rng = random.Random(seed)
    sft, rl = [], []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt, answer = f"{a}*{b}=", str(a * b)
        rl.append({"id": f"calc-{seed}-{i}", "prompt": prompt, "answer": answer})
        head = "tools: calculator\n" + prompt
        if rng.random() < tool_share:
            call = _call_text(f"{a}*{b}")
            sft.append({"prompt": head, "solution": call, "answer": answer})
            sft.append({"prompt": f"{head}{call}</s><tool_response>{answer}</tool_response>",
                        "solution": f"#### {answer}", "answer": answer})
        else:
            sft.append({"prompt": head, "solution": f"#### {answer}", "answer": answer})
    return sft, rl


@register_experiment("agent-calculator")
@dataclass
class CalculatorConfig(OwnStartMixin, AsyncGRPOMathConfig):
    """Asynchronous GRPO of the tool-calling ``calculator`` agent (a user package)."""

    dataset: RLDataConfig = field(default_factory=lambda: RLDataConfig(task="arithmetic", n_train=4000, n_test=64))
    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=4,
                                                                       max_new_tokens=40))
    rollout: AsyncRolloutConfig = field(default_factory=lambda: AsyncRolloutConfig(
        agent="calculator", agent_args={"n_samples": 4, "export": "completion", "turn_discount": 0.9,
                                        "max_tokens": 40}))
    tool_share: float = field(default=0.5, metadata={"help": "share of SFT demonstrations that call the tool"})
    batch_size: int = field(default=16, metadata={"help": "rollouts (prompts, each a group) per train step"})
    max_train_steps: int = field(default=40, metadata={"help": "train steps"})
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))

    _name = "agent-calculator"
    _start_name = "calculator"
    _markup = MARKUP
    _sft_extra = ("eval_max_new_tokens=40", "dataset.max_prompt_len=120")

    def _data_tag(self) -> str:
        return f"calculator-v{DATA_VERSION}-t{self.tool_share:g}"

    def make_rows(self, n: int, seed: int) -> tuple[list[dict], list[dict]]:
        return make_rows(n, seed, self.tool_share)

    def _eval_spec(self, test: str, data_args: dict[str, Any]) -> Any:
        return None  # held-out greedy answers without the tool would not measure this agent

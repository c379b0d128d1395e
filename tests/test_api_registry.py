"""Registry lookups, near-miss suggestions and registration conflicts."""
from __future__ import annotations

import pytest

from realflow.api.registry import Registry, RegistryError, closest, did_you_mean


def test_register_decorator_and_call_and_lookup():
    reg: Registry[object] = Registry("widget")

    @reg.register("ppo_actor")
    class PPOActor:
        pass

    assert reg.register("ppo_critic", int) is int
    assert reg.get("ppo_actor") is PPOActor and "ppo_critic" in reg and len(reg) == 2
    assert reg.names() == ["ppo_actor", "ppo_critic"] and list(reg) == reg.names()
    assert "ppo_actor" in repr(reg)


def test_unknown_name_names_it_and_closest():
    reg: Registry[object] = Registry("interface")
    for n in ("ppo_actor", "ppo_critic", "sft"):
        reg.register(n, object())
    with pytest.raises(RegistryError) as e:
        reg.get("ppo_acter")
    msg = str(e.value)
    assert msg.startswith("unknown interface 'ppo_acter'; did you mean 'ppo_actor'")
    assert "known: ppo_actor, ppo_critic, sft" in msg and "--import" in msg
    assert isinstance(e.value, KeyError)
    with pytest.raises(RegistryError, match="unknown interface 'zzz' \\(known"):
        reg.get("zzz")
    with pytest.raises(RegistryError, match="none registered"):
        Registry("x").get("a")


def test_conflicts_and_overwrite():
    reg: Registry[object] = Registry("graph builder")
    reg.register("a", len)
    reg.register("a", len)  # same object again is fine (re-import)
    with pytest.raises(RegistryError, match="graph builder 'a' is already registered to builtins.len"):
        reg.register("a", max)
    reg.register("a", max, overwrite=True)
    assert reg.get("a") is max
    reg.unregister("a")
    assert "a" not in reg
    with pytest.raises(RegistryError, match="non-empty string"):
        reg.register("", max)


def test_closest_prefers_shared_prefix():
    assert closest("ref", ["rew_inf", "ref_inf", "zzz"]) == ["ref_inf", "rew_inf"]
    assert did_you_mean("lr", ["lr_scale", "zz"]) == "; did you mean 'lr_scale'?"
    assert did_you_mean("qqq", ["a"]) == ""

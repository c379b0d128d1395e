"""ModelInterface defaults, the interface registry and make_interface argument checks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.interface import (
    InterfaceError, Model, ModelInterface, interface_registry, make_interface, register_interface,
)
from realflow.api.mfc import ModelInterfaceType

torch.set_num_threads(1)


@register_interface("test_api_scaler")
class Scaler(ModelInterface):
    """Multiplies token ids; real enough to exercise dispatch."""

    def __init__(self, factor: int = 2, *, key: str = "packed_input_ids"):
        self.factor, self.key = factor, key

    def inference(self, model, batch, mb_spec):
        out = [mb.data[self.key] * self.factor for mb in batch.micro_batches(mb_spec, self.key)]
        return SequenceBatch(batch.ids, {"scaled": batch.seqlens[self.key]}, {"scaled": torch.cat(out)})


@register_interface("test_api_dc")
@dataclasses.dataclass
class DCInterface(ModelInterface):
    temperature: float
    top_k: int = 0


@register_interface("test_api_kw")
class KwInterface(ModelInterface):
    def __init__(self, **kw):
        self.kw = kw


def test_make_and_dispatch():
    iface = make_interface("test_api_scaler", factor=3)
    b = SequenceBatch(["a", "b"], {"packed_input_ids": [[2], [1]]}, {"packed_input_ids": torch.tensor([1, 2, 3])})
    model = Model("actor", module=torch.nn.Identity())
    out = iface.method_for(ModelInterfaceType.INFERENCE)(model, b, MicroBatchSpec(n_mbs=2))
    assert out.data["scaled"].tolist() == [3, 6, 9]
    assert iface.method_for("train_step").__name__ == "train_step"
    assert model.inc_version() == 1 and model.version == 1 and model.tokenizer is None
    assert make_interface("test_api_dc", temperature=0.5).temperature == 0.5
    assert make_interface("test_api_kw", anything=1).kw == {"anything": 1}


def test_default_methods_name_class_and_method():
    iface = make_interface("test_api_scaler")
    model = Model("actor", None)
    for method, args in [("generate", (model, None, MicroBatchSpec())), ("train_step", (model, None, MicroBatchSpec())),
                         ("evaluate", (model, None)), ("save", (model, "/tmp/x"))]:
        with pytest.raises(NotImplementedError, match=f"interface Scaler does not implement {method}\\(\\)"):
            getattr(iface, method)(*args)


def test_make_interface_errors():
    with pytest.raises(InterfaceError, match="unknown interface 'test_api_scalr'; did you mean 'test_api_scaler'"):
        make_interface("test_api_scalr")
    with pytest.raises(InterfaceError, match="interface 'test_api_scaler' \\(Scaler\\) has no argument 'facter'; did you mean 'factor'"):
        make_interface("test_api_scaler", facter=2)
    with pytest.raises(InterfaceError, match="has no argument 'temp'; did you mean 'temperature'"):
        make_interface("test_api_dc", temp=1.0)
    with pytest.raises(InterfaceError, match="cannot build interface 'test_api_dc'.*temperature"):
        make_interface("test_api_dc")
    with pytest.raises(InterfaceError, match="must decorate a ModelInterface subclass"):
        register_interface("bad")(int)
    assert "test_api_scaler" in interface_registry.names()

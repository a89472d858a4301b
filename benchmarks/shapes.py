"""Models made of parameter shapes alone: ResNet-50's and GPT-2 small's gradients without torchvision
or transformers.

A gradient exchange sees only the parameters' shapes and order, so a module
holding parameters of a real model's shapes, in its ``named_parameters()``
order, gives every route the buckets, plans and kernels that model would. Its
forward is cheap and touches every parameter: with ``x`` one fixed random vector
as long as the largest parameter,

    loss = sum_i  dot(p_i.flatten(), x[:numel(p_i)])

so ``d loss / d p_i = x[:numel(p_i)]`` (one multiply per parameter in backward):
dense, random, different within each tensor.

* ``resnet50``: torchvision's ResNet-50, 161 tensors, 25,557,032 parameters
  (conv 7x7, bottleneck stages of 3, 4, 6, 3 blocks, each conv followed by a
  batch norm's weight and bias, a projection in each stage's first block, fc 1000);
* ``gpt2``: GPT-2 small, 148 tensors, 124,439,808 parameters (wte 50257x768,
  wpe 1024x768, 12 blocks of ln_1, attn c_attn/c_proj, ln_2, mlp c_fc/c_proj,
  ln_f; the LM head tied to wte, so not a parameter of its own).
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

Shape = Tuple[int, ...]
#: Parameter count of each model (torchvision resnet50, transformers GPT2LMHeadModel).
PARAMETERS = {"resnet50": 25_557_032, "gpt2": 124_439_808}
#: Number of parameter tensors of each model.
TENSORS = {"resnet50": 161, "gpt2": 148}


def resnet50_shapes() -> List[Tuple[str, Shape]]:
    """``(name, shape)`` of ResNet-50's parameters in torchvision's ``named_parameters()`` order."""

    def conv_bn(prefix: str, conv: str, bn: str, out: int, inp: int, kernel: int) -> List[Tuple[str, Shape]]:
        return [(f"{prefix}{conv}.weight", (out, inp, kernel, kernel)),
                (f"{prefix}{bn}.weight", (out,)), (f"{prefix}{bn}.bias", (out,))]

    shapes = conv_bn("", "conv1", "bn1", 64, 3, 7)
    inplanes = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for block in range(blocks):
            prefix, out = f"layer{stage}.{block}.", 4 * width
            shapes += conv_bn(prefix, "conv1", "bn1", width, inplanes, 1)
            shapes += conv_bn(prefix, "conv2", "bn2", width, width, 3)
            shapes += conv_bn(prefix, "conv3", "bn3", out, width, 1)
            if block == 0:
                shapes += conv_bn(prefix, "downsample.0", "downsample.1", out, inplanes, 1)
            inplanes = out
    return shapes + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def gpt2_shapes(
    layers: int = 12, width: int = 768, vocab: int = 50257, positions: int = 1024
) -> List[Tuple[str, Shape]]:
    """``(name, shape)`` of GPT-2 small's parameters in transformers' ``named_parameters()`` order."""
    shapes: List[Tuple[str, Shape]] = [("wte.weight", (vocab, width)), ("wpe.weight", (positions, width))]
    for i in range(layers):
        h = f"h.{i}."
        shapes += [(h + "ln_1.weight", (width,)), (h + "ln_1.bias", (width,)),
                   (h + "attn.c_attn.weight", (width, 3 * width)), (h + "attn.c_attn.bias", (3 * width,)),
                   (h + "attn.c_proj.weight", (width, width)), (h + "attn.c_proj.bias", (width,)),
                   (h + "ln_2.weight", (width,)), (h + "ln_2.bias", (width,)),
                   (h + "mlp.c_fc.weight", (width, 4 * width)), (h + "mlp.c_fc.bias", (4 * width,)),
                   (h + "mlp.c_proj.weight", (4 * width, width)), (h + "mlp.c_proj.bias", (width,))]
    return shapes + [("ln_f.weight", (width,)), ("ln_f.bias", (width,))]


SHAPES = {"resnet50": resnet50_shapes, "gpt2": gpt2_shapes}


def _module(names: List[str], shapes: List[Shape]) -> Any:
    import torch

    class ShapeModel(torch.nn.Module):
        """Parameters of the given shapes; ``forward(x)`` is the loss of the module docstring."""

        def __init__(self) -> None:
            super().__init__()
            for name, shape in zip(names, shapes):  # "layer1.0.conv1.weight" as "layer1_0_conv1_weight"
                weight = torch.nn.Parameter(torch.empty(shape).normal_(0.0, 0.02))
                self.register_parameter(name.replace(".", "_"), weight)

        def forward(self, x: Any) -> Any:
            return torch.stack([torch.dot(p.reshape(-1), x[: p.numel()]) for p in self.parameters()]).sum()

    return ShapeModel()


class ShapeWorkload:
    """A workload (the interface of :class:`~benchmarks.routes.MLPWorkload`) over a shape model."""

    def __init__(self, model: str, device: Any, seed: int) -> None:
        import torch

        self.name, self.device, self.seed, self.batch = model, device, seed, None
        named = SHAPES[model]()
        self.names, self.shapes = [n for n, _ in named], [s for _, s in named]
        self.parameter_count = sum(math.prod(s) for s in self.shapes)
        largest = max(math.prod(s) for s in self.shapes)
        self.inputs = torch.randn(largest, generator=torch.Generator().manual_seed(seed)).to(device)
        self.description = (
            f"{model} parameter shapes ({len(self.shapes)} tensors, {self.parameter_count:,} parameters), "
            f"loss sum_i dot(p_i, x)"
        )

    def build(self) -> Any:
        """A fresh shape model on the device, the same initial weights every time."""
        import torch

        torch.manual_seed(self.seed)
        return _module(self.names, self.shapes).to(self.device).train()

    def loss(self, model: Any) -> Any:
        return model(self.inputs)


__all__ = ["ShapeWorkload", "resnet50_shapes", "gpt2_shapes", "PARAMETERS", "TENSORS"]

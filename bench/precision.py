"""Mixed precision: step time of the built-in GPT in fp32, torch.autocast bf16, and op-list
autocast with a typical BERT list (Optimum for Intel Gaudi's published one), in eager mode and
under torch.compile; interleaved repeats, median step time after warm-up.

    python bench/precision.py [--modes eager compile] [--steps 40] [--warmup 10] [--repeats 3]
"""
from __future__ import annotations


from hputrain import AcceleratorConfig
from hputrain.accelerators import detect_accelerator
from hputrain.models.gpt import GPT

from common import bf16_where_native, model_and_data, parser, print_table, trainer_step_time

BERT_LISTS = AcceleratorConfig(
    use_torch_autocast=True,
    autocast_bf16_ops=["add", "addmm", "bmm", "div", "dropout", "gelu", "iadd", "linear", "layer_norm",
                       "matmul", "mm", "rsub", "softmax", "truediv"],
    autocast_fp32_ops=["embedding", "nll_loss", "log_softmax"])
SETTINGS = {
    "fp32": (None, False),
    "bf16 autocast": (None, True),
    "bf16 op-list autocast (BERT list)": (BERT_LISTS, True),
}


def main() -> None:
    p = parser(__doc__, steps=40, repeats=3)
    p.add_argument("--modes", nargs="+", default=["eager", "compile"])
    opts = p.parse_args()
    opts.bf16 = "per row"
    accelerator = detect_accelerator()
    # Where bf16 is only emulated, its rows would not finish: fp32 alone is measured.
    native = bf16_where_native(accelerator, True)
    settings = {name: s for name, s in SETTINGS.items() if native or not s[1]}
    config, data = model_and_data(opts)
    for mode in opts.modes:
        runs = {name: [] for name in settings}
        for _ in range(opts.repeats):
            for name, (accelerator_config, bf16) in settings.items():
                runs[name].append(trainer_step_time(GPT(config), data, opts, accelerator_config,
                                                    bf16=bf16, execution_mode=mode))
        print(f"\nexecution mode: {mode}")
        print_table(accelerator, opts, runs, baseline="bf16 autocast" if native else "fp32",
                    column="precision")


if __name__ == "__main__":
    main()

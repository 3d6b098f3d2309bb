"""An Optimum for Intel Gaudi script's opening, for `hputrain doctor` where optimum-habana is not
installed: the doctor says so in one line."""
from optimum.habana import GaudiConfig, GaudiTrainer, GaudiTrainingArguments  # noqa: F401

args = GaudiTrainingArguments(output_dir="out", use_habana=True, use_lazy_mode=True)

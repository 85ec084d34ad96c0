"""Settings, loaded from TOML into validated dataclasses (torchtitan style) and checked once:

model.py       a model's settings from ``[model]`` (configs/models/) or a `transformers` folder
hardware.py    a node and its network, for analytic profiles (configs/hardware/)
experiment.py  one published training setting: model, hardware, parallelism, batch (configs/experiments/)
run.py         one training run: everything `terapipe train` takes (``--config run.toml``)
demo.py        the one-command demo's settings (`terapipe run`)
device.py      which device and precision a process computes in
bundled.py     the configs shipped with the package, and the one TOML reader
"""

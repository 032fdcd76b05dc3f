"""tpcomm's demos, apart from the library: `python -m tpcomm.demo` (the main
job: tensor-parallel decoding, `decode.py`; across simulated hosts with
`--hosts 2`, `hosts.py`), `python -m tpcomm.demo.ddp` (DDP training), and
the model they share (`tp_model.py`)."""

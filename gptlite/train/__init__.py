"""Training: the objectives train.py chooses among (`objective`, on `objective_base`: pretraining and SFT, DPO in
`preference`, RL in `rl`), the features a run switches on (`features`), LoRA (`lora`), the optimizers (`optim`), the
update (`update`), the metrics file (`metrics`), several processes under torchrun (`distributed`) and the resolved
run configuration (`run_config`)."""

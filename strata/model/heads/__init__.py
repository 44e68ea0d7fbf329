"""Draft heads trained for checkpoints that ship without one (package data, found by strata.model.loader):
smollm2-135m-instruct-mtp.safetensors, a multi-token-prediction head for the embedded default, trained by
train/mtp_head.py (see train/README.md)."""

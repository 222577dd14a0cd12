"""The model: embedding -> zoneout LSTM layers -> decoder (lm), and the cells that run the
recurrence (cells/: reference; fused CPU with a compiled C++ step or in Python; plain, torch's
own LSTM kernel when there is no zoneout; Triton on CUDA), all with one signature.

May import: zlm.errors. Knows nothing of data files, checkpoints, training or devices.
"""

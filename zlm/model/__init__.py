"""The model: embedding -> zoneout LSTM layers -> decoder (lm), and the cells that run the
recurrence (cells/: reference, fused CPU, Triton), all with one signature.

May import: zlm.errors. Knows nothing of data files, checkpoints, training or devices.
"""

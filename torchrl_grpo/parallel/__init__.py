"""Data-parallel training over torch.distributed ranks (FSDP2): the process group, the sharding, the calls
every rank makes together, and the launcher that starts the ranks. Imports core, objective and config."""

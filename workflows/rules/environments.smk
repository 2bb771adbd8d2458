# --sdm apptainer: the image sees the node's GPUs only with apptainer's --nv (CUDA) or --rocm
# (ROCm); the config's container_gpu adds the flag to --apptainer-args.
import shlex

# config container_gpu -> the apptainer flag that gives the image the node's GPUs
GPU_FLAGS = {"cuda": "--nv", "rocm": "--rocm"}


def apptainer_args(args: str, config: dict) -> str:
    """--apptainer-args with the GPU flag of ``container_gpu`` added once (a Slurm job's own
    snakemake is handed the args with it already). A GPU sweep without one would run its
    cells in an image that sees no GPU: a ConfigError."""
    have = set(shlex.split(args))
    flag = GPU_FLAGS.get(config.get("container_gpu", "none"))
    if flag and flag not in have:
        return f"{args} {flag}".strip()
    if config.get("gpu", False) and not have & set(GPU_FLAGS.values()):
        raise ConfigError(
            "container_gpu: gpu: true under --sdm apptainer, but no GPU flag for the image: set "
            "container_gpu to cuda (apptainer --nv) or rocm (--rocm), or pass --apptainer-args"
        )
    return args


if "apptainer" in SDM:
    try:
        workflow.deployment_settings.apptainer_args = apptainer_args(
            workflow.deployment_settings.apptainer_args, config
        )
    except ConfigError as e:
        raise ValueError(f"config error: {e}") from None

"""ONE table of the SLURM_* variables slurmagent reads, and small readers over an environment.

Slurm tells a job, a step and a prolog who they are through the environment; each variable
is read here only, so a fallback (`SLURM_JOB_NUM_NODES`, else the older `SLURM_NNODES`) is
written once and every module agrees on it. Pure: a Mapping in, a value out; no I/O. The
healthy prolog imports it, so it imports nothing.
"""

from __future__ import annotations

TYPE_CHECKING = False  # type checkers take it as True; no `typing` import at run time
if TYPE_CHECKING:
    from collections.abc import Mapping

JOB_ID = "SLURM_JOB_ID"
JOBID = "SLURM_JOBID"
ARRAY_JOB_ID = "SLURM_ARRAY_JOB_ID"
ARRAY_TASK_ID = "SLURM_ARRAY_TASK_ID"
RESTART_COUNT = "SLURM_RESTART_COUNT"
JOB_NUM_NODES = "SLURM_JOB_NUM_NODES"
NNODES = "SLURM_NNODES"
JOB_NODELIST = "SLURM_JOB_NODELIST"
NODELIST = "SLURM_NODELIST"
NODEID = "SLURM_NODEID"
STEP_ID = "SLURM_STEP_ID"
STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"
JOB_EXIT_CODE = "SLURM_JOB_EXIT_CODE"
GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"
NODENAME = "SLURMD_NODENAME"
CONF = "SLURM_CONF"

# Every variable slurmagent reads, with who sets it and what it is read for.
VARIABLES = {
    JOB_ID: "job, step, prolog, epilog: the job id (an array task's own id, not ARRAYJOBID_TASKID)",
    JOBID: "the older name of SLURM_JOB_ID: the hooks fall back on it",
    ARRAY_JOB_ID: "array task: the array's job id, for the ARRAYJOBID_TASKID that scontrol requeue takes",
    ARRAY_TASK_ID: "array task: its index in the array",
    RESTART_COUNT: "job: how many times it was requeued (0 or unset on the first attempt)",
    JOB_NUM_NODES: "job: how many nodes it holds (a multi-node job has node agents)",
    NNODES: "the older name of SLURM_JOB_NUM_NODES",
    JOB_NODELIST: "job: its nodes as a hostlist, to name a silent node by index",
    NODELIST: "the older name of SLURM_JOB_NODELIST",
    NODEID: "step task: the index of its node in the job (a node agent's index)",
    STEP_ID: "step: its id ('batch' or unset in the batch step; a number under srun)",
    STEP_NUM_TASKS: "step: its task count (a wrapper started as one of several tasks is refused)",
    JOB_EXIT_CODE: "epilog: the job's exit status",
    GPUS_ON_NODE: "job: GPUs allocated on each node (the goodput ledger's GPU count)",
    NODENAME: "slurmd, for its jobs and hooks: this node's Slurm name (several slurmd may share a host)",
    CONF: "any Slurm command: the slurm.conf path",
}


def job_id(env: Mapping[str, str], *, old_name: bool = False) -> str | None:
    """The job id (None outside a job); `old_name` also takes `SLURM_JOBID`, as the hooks do."""
    return env.get(JOB_ID) or (env.get(JOBID) if old_name else None) or None


def array_task_id(env: Mapping[str, str]) -> str | None:
    """`ARRAYJOBID_TASKID` for an array task, the id `scontrol requeue` takes; None otherwise."""
    array_job, task = env.get(ARRAY_JOB_ID), env.get(ARRAY_TASK_ID)
    return f"{array_job}_{task}" if array_job and task else None


def count(value: str | None) -> int:
    """A count from the environment: 0 when unset, malformed or negative."""
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def restart_count(env: Mapping[str, str]) -> int:
    """How many times this job was requeued (0 on the first attempt, or when unreadable)."""
    return count(env.get(RESTART_COUNT))


def gpus_on_node(env: Mapping[str, str]) -> int:
    """GPUs the job holds on this node: 0 when unset or malformed (a CPU job)."""
    return count(env.get(GPUS_ON_NODE))


def num_nodes(env: Mapping[str, str]) -> int:
    """The job's node count: 1 when unset; ValueError when malformed (each caller says what that means)."""
    return int(env.get(JOB_NUM_NODES) or env.get(NNODES) or 1)


def node_list(env: Mapping[str, str]) -> str:
    """The job's nodes as a hostlist expression ("" when unset)."""
    return env.get(JOB_NODELIST) or env.get(NODELIST) or ""


def node_index(env: Mapping[str, str]) -> int:
    """This step task's node index in the job (0 when unset); ValueError when malformed."""
    return int(env.get(NODEID) or 0)


def step_id(env: Mapping[str, str]) -> str | None:
    """The step's id: None or "batch" in the batch step, a number in a step srun started."""
    return env.get(STEP_ID)


def step_num_tasks(env: Mapping[str, str]) -> int:
    """The step's task count (1 when unset); ValueError when malformed."""
    return int(env.get(STEP_NUM_TASKS) or 1)


def job_exit_code(env: Mapping[str, str]) -> str | None:
    """The job's exit status as the epilog got it, unparsed (the hook refuses a malformed one)."""
    return env.get(JOB_EXIT_CODE)


def slurmd_node(env: Mapping[str, str]) -> str | None:
    """This node's Slurm name as slurmd set it; None outside slurmd's jobs and hooks."""
    return env.get(NODENAME) or None


def node_name(env: Mapping[str, str], host_name: str) -> str:
    """This node's Slurm name: slurmd's, else the short form of `host_name` (the part before a dot)."""
    return env.get(NODENAME) or host_name.split(".")[0]


def conf(env: Mapping[str, str]) -> str | None:
    """The slurm.conf path the environment names, if any."""
    return env.get(CONF) or None

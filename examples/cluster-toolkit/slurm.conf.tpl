# slurm.conf
# https://slurm.schedmd.com/slurm.conf.html
# https://slurm.schedmd.com/configurator.html

ProctrackType=proctrack/cgroup
SlurmctldPidFile=/var/run/slurm/slurmctld.pid
SlurmdPidFile=/var/run/slurm/slurmd.pid
TaskPlugin=task/affinity,task/cgroup
MaxNodeCount=64000

#
#
# SCHEDULING
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory

#
#
# LOGGING AND ACCOUNTING
AccountingStoreFlags=job_comment
JobAcctGatherFrequency=30
JobAcctGatherType=jobacct_gather/cgroup
SlurmctldDebug=info
SlurmdDebug=info
DebugFlags=Power

#
#
# TIMERS
MessageTimeout=60

# BEGIN slurmagent: the slurm.conf lines slurmagent needs that have no Cluster Toolkit setting
# (docs/admin/cluster-toolkit.md). Prolog=/Epilog= come from the controller's prolog_scripts /
# epilog_scripts, PrologFlags=Alloc and nohold_on_prolog_fail from its cloud_parameters (cloud.conf).
# A hook never runs longer than this (slurmagent's own deadline is [health] timeout_s = 15 s);
# with the Toolkit's DCGM prolog on (enable_chs_gpu_health_check_prolog), raise it as the
# Toolkit's own long-prolog-slurm.conf.tpl does (600).
PrologEpilogTimeout=120
# Health between jobs: `slurmagent healthcheck` (the shim `slurmagent install` writes on the image).
HealthCheckProgram=/etc/slurmagent/hooks/healthcheck
HealthCheckInterval=300
HealthCheckNodeState=ANY,CYCLE
# END slurmagent

################################################################################
#              vvvvv  WARNING: DO NOT MODIFY SECTION BELOW  vvvvv              #
################################################################################

{slurmctld_hosts}

AuthType=auth/{auth_key}
AuthInfo=cred_expire=120
AuthAltTypes=auth/jwt
CredType=cred/{auth_key}
MpiDefault={mpi_default}
ReturnToService=2
SlurmctldPort={control_host_port}
SlurmdPort=6818
SlurmdSpoolDir=/var/spool/slurmd
SlurmUser=slurm
StateSaveLocation={state_save}

#
#
# LOGGING AND ACCOUNTING
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={accounting_storage_host}
{accounting_storage_backup_host}
ClusterName={name}
SlurmctldLogFile={slurmlog}/slurmctld.log
SlurmdLogFile={slurmlog}/slurmd-%n.log

#
#
# GENERATED CLOUD CONFIGURATIONS
include cloud.conf

################################################################################
#              ^^^^^  WARNING: DO NOT MODIFY SECTION ABOVE  ^^^^^              #
################################################################################

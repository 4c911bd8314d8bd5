#!/usr/bin/env bash
# Several nodes. Two ways, same config, same rank layout:
#
# (a) DeepSpeed + hostfile, started ONCE on node 0 (pdsh/ssh to the others; every node needs
#     the same checkout path and environment):
#       MASTER_ADDR=node0 bash launch/multinode.sh --hostfile launch/hostfile.example --dry-run
#       MASTER_ADDR=node0 bash launch/multinode.sh --hostfile my_hosts --set train.max_steps=10
# (b) torchrun, started on EVERY node with its own --node-rank (SLURM, k8s, no ssh):
#       bash launch/multinode.sh --launcher torchrun --num-nodes 2 --num-gpus 4 \
#           --node-rank $NODE_RANK --master-addr node0 --master-port 29500
#
# How ranks map to nodes: node by node (hostfile order / node_rank): node i holds global
# ranks i*G .. i*G+G-1 for G GPUs per node. sp groups are consecutive ranks, so with sp
# dividing G every Ulysses all-to-all stays on one node's NVLink and only data-parallel
# gradient reduction crosses nodes; otherwise the topology printout names the groups that
# cross and the cost. The default config is ext64k_4gpu (sp=4): on 2 nodes x 4 GPUs that is
# dp 2 x sp 4.
#
# NCCL: DeepSpeed's pdsh runner forwards every NCCL_* and PYTHON* variable set here to the
# other nodes (anything else: put KEY=VALUE lines in ./.deepspeed_env). Set the interface
# for your cluster, e.g. NCCL_SOCKET_IFNAME=eth0 (bootstrap / TCP) and NCCL_IB_HCA=mlx5 (IB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # NVLink multicast (NVLS) off: forbidden on the lent H200s
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}            # INFO shows which transport (NVLink/IB/socket) each ring uses
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}    # tolerate a congested fabric instead of hanging
defaults=(--device cuda --config configs/ext64k_4gpu.yaml --master-addr "${MASTER_ADDR:-node0}"
          --master-port "${MASTER_PORT:-29500}")
case " $* " in
  *" --launcher torchrun "*|*" --hostfile "*) ;;
  *) defaults+=(--hostfile launch/hostfile.example) ;;
esac
exec "$PY" -m megablu.cli train "${defaults[@]}" "$@"

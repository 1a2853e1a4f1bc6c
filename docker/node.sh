#!/bin/sh
# The image's entrypoint: `fusionllm node` on the image's fixed ports, its identity and work
# directory on the /data volume, listening on the container's own address (what its peers on
# the same docker network dial). Flags given to `docker run IMAGE ...` come after these
# defaults, so they override them (argparse keeps the last).
#   node.sh [fusionllm node flags...]   run the node
#   node.sh --health                    the HEALTHCHECK: ask the running node whether it answers
#   node.sh --bootstrap-key KEY HOST [flags...]
#                                       join the node whose identity key file is KEY (a shared
#                                       volume) at HOST (a name on the docker network): its
#                                       address is known before it starts (compose.yaml)
set -eu

CONTROL_PORT=7300
DHT_PORT=7301
LANE_PORT=7302

# The container's address on its first network (docker writes it into /etc/hosts).
address=$(hostname -i | cut -d' ' -f1)

# Where the node listens, as the health check must ask it: the flags given last win, as in
# argparse (`--network host` runs give their own --host).
ADDRESS_FILE=/tmp/fusionllm-node.address
if [ "${1:-}" = "--health" ]; then
    read -r host port dht_port <"$ADDRESS_FILE"
    exec fusionllm health --host "$host" --port "$port" --dht-port "$dht_port"
fi
if [ "${1:-}" = "--bootstrap-key" ]; then
    key=$2 boot_host=$3
    shift 3
    waited=0
    until [ -s "$key" ]; do  # the bootstrap node writes it as it starts
        [ "$waited" -lt 300 ] || { echo "node.sh: no key file $key after 300 s" >&2; exit 1; }
        sleep 1
        waited=$((waited + 1))
    done
    peer=$(python3 -c 'import sys
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
print(peer_id_of(load_or_create_identity(sys.argv[1])))' "$key")
    ip=$(getent hosts "$boot_host" | cut -d' ' -f1)
    [ -n "$ip" ] || { echo "node.sh: cannot resolve $boot_host" >&2; exit 1; }
    set -- --bootstrap "/ip4/$ip/tcp/$DHT_PORT/p2p/$peer" "$@"
fi
host=$address port=$CONTROL_PORT dht_port=$DHT_PORT previous=
for arg in "$@"; do
    case "$previous" in
        --host) host=$arg ;;
        --port) port=$arg ;;
        --dht-port) dht_port=$arg ;;
    esac
    case "$arg" in
        --host=*) host=${arg#--host=} ;;
        --port=*) port=${arg#--port=} ;;
        --dht-port=*) dht_port=${arg#--dht-port=} ;;
    esac
    previous=$arg
done
echo "$host $port $dht_port" >"$ADDRESS_FILE"
exec fusionllm node --host "$address" --port "$CONTROL_PORT" --dht-port "$DHT_PORT" \
    --lane-port "$LANE_PORT" --key /data/identity.key --work-dir /data/work "$@"

# shellcheck shell=bash
# ports_lib.sh - sourced by the tests that start daemons on fixed TCP ports
# (ops_slurm.sh, ops_deploy.sh). Provides:
#   free_ports N   the first of N consecutive ports, each free to bind now,
#                  below the kernel's ephemeral range; empty if none found
# Why below that range: a port drawn from inside it can be taken by another
# test's outgoing connection (mpirun's, say) between the draw and the bind,
# and a daemon then fails with "Address already in use" (a CI run of
# ops_slurm did). A port free now can still be taken later by a listener
# of another test; the callers retry on that.
free_ports() {
    /usr/bin/python3 - "$1" << 'PY'
import random, socket, sys
n = int(sys.argv[1])
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
top = lo - n if lo > 10000 + 2 * n else 60000 - n
for _ in range(200):
    p = random.randrange(10000, top)
    socks = []
    try:
        for q in range(p, p + n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            socks.append(s)
            s.bind(("", q))
    except OSError:
        continue
    finally:
        for s in socks:
            s.close()
    print(p)
    break
PY
}

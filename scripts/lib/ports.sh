# Shared by the benchmark scripts (sourced): a free loopback port, and waiting for a server to open one.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# wait_port PORT [TRIES]: TRIES × 0.1 s (default 100); a restart replaying 1M keys needs more.
wait_port() { for _ in $(seq "${2:-100}"); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; return 1; }

# Reading processes from /proc, so that a pid is signalled only while it is still the process
# it was recorded as (pids are reused: pid_max is 32,768 on many machines). Sourced by
# scripts/lib/keep and scripts/control-plane.

# The start time of process $1 (field 22 of /proc/PID/stat, read after the command name, which
# may hold spaces and parentheses), or nothing once it is gone.
started() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) }
  # shellcheck disable=SC2086 # the fields are words
  set -- $stat
  [ "$1" = Z ] || printf '%s' "${20}"
}

# Whether process $1 runs, not as a zombie, the command line saved in file $2 (one argument
# per line).
runs() {
  local pid=$1 file=$2
  [ -n "$pid" ] && [ -f "$file" ] && [ -n "$(started "$pid")" ] || return 1
  cmp -s <(tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null) "$file"
}

# Process $1 and every process it started that still runs (its descendants), one per line,
# each as "PID STARTTIME", parents before their children.
tree() {
  ps -e -o pid=,ppid= | awk -v root="$1" '
    { parent[$1] = $2; order[NR] = $1 }
    END {
      in_tree[root] = 1
      print root
      do {
        grew = 0
        for (i = 1; i <= NR; i++) {
          p = order[i]
          if (!(p in in_tree) && (parent[p] in in_tree)) { in_tree[p] = 1; print p; grew = 1 }
        }
      } while (grew)
    }' | while read -r pid; do
      since=$(started "$pid")
      [ -z "$since" ] || printf '%s %s\n' "$pid" "$since"
    done
}

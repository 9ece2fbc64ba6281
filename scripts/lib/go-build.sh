# Building Go tools from their published modules, cached by version. Sourced by
# scripts/control-plane and scripts/peers, which set $modules (the folder of module
# directories, each with a go.mod and go.sum that pin the release) and $cache.

say() { printf '==> %s\n' "$*" >&2; }
die() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }

# The version of module $2 that $modules/$1/go.mod requires.
required() { awk -v m="$2" '$1 == "require" && $2 == m { print $3 } $1 == m { print $2 }' "$modules/$1/go.mod" | head -1; }

# Builds package $2 of module directory $1 into the cache as $3 at version $4 (ldflags $5),
# unless there already; prints its path. The cache key is the version and a hash of every file
# of the module directory (go.mod, go.sum, any Go source of ours) and of the directories in $6
# (what its go.mod replaces), so any change rebuilds.
build_one() {
  local dir=$1 package=$2 name=$3 version=$4 ldflags=${5:-} extra=${6:-}
  local key files
  # shellcheck disable=SC2086 # $extra is a list of directories
  files=$(cd "$modules" && find "$dir" $extra -type f | LC_ALL=C sort)
  key="$version-$(cd "$modules" && cat $files | sha256sum | cut -c1-12)"
  local out="$cache/$name-$key/$name"
  if [ ! -x "$out" ]; then
    command -v go >/dev/null || die "Go is needed to build $name (the machine's Go 1.26, not Debian's)"
    say "building $name $version from its module (once; a cold build takes minutes)"
    local started=$SECONDS
    mkdir -p "$(dirname "$out")"
    (cd "$modules/$dir" && GOFLAGS=-mod=readonly CGO_ENABLED=0 \
      go build -trimpath -ldflags "$ldflags" -o "$out.tmp" "$package")
    mv "$out.tmp" "$out"
    say "built $name in $((SECONDS - started)) s: $out"
  fi
  printf '%s\n' "$out"
}

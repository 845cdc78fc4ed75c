#!/usr/bin/env bash
# The voice's training state (issue 35) lives in git history, not in the working tree: every
# device call carries the whole tree, and a snapshot of 13-28 MB in it left the room and
# capacity calls no room in their 64 MiB. voice-state.ref names the commit whose voice-state/
# holds the parts (state.NNN + state.json, as `python -m breezert_train.pipeline` packs them).
#
#   bash bench/voice_state.sh restore [DIR]       # DIR (default .voicestate/, git-ignored) <-
#                                                 # the parts at the commit voice-state.ref names
#   bash bench/voice_state.sh store SRC "message" # SRC's state.* -> a commit of voice-state/
#                                                 # ("message"), named in voice-state.ref; then
#                                                 # a second commit takes them out of the tree
#
# store needs a clean index (it commits) and is run in the checkout's root; restore needs the
# history (a shallow clone lacks the commit: git fetch --unshallow).
set -euo pipefail
REF=voice-state.ref
verb=${1:?verb: restore or store}

commit_of_ref() {
  sed -n 's/^commit \([0-9a-f]\{40\}\)$/\1/p' "$REF"
}

case "$verb" in
  restore)
    dir=${2:-.voicestate}
    commit=$(commit_of_ref)
    [ -n "$commit" ] || { echo "$REF names no commit" >&2; exit 2; }
    git cat-file -e "$commit^{commit}" 2>/dev/null || {
      echo "commit $commit (from $REF) is not in this clone: a shallow clone lacks it;" \
        "git fetch --unshallow" >&2; exit 3; }
    parts=$(git ls-tree --name-only "$commit" voice-state/)
    [ -n "$parts" ] || { echo "commit $commit holds no voice-state/" >&2; exit 3; }
    mkdir -p "$dir"
    rm -f "$dir"/state.*
    for path in $parts; do
      git show "$commit:$path" > "$dir/$(basename "$path")"
    done
    echo "restored $(echo "$parts" | wc -w) parts of $commit into $dir"
    ;;
  store)
    src=${2:?SRC: the folder holding the returned state.* parts}
    message=${3:?message: what the parts are, the subject of their commit}
    ls "$src"/state.* >/dev/null 2>&1 || { echo "no state.* in $src" >&2; exit 2; }
    git diff --cached --quiet || { echo "the index is not clean: commit or reset first" >&2; \
      exit 2; }
    rm -rf voice-state
    mkdir voice-state
    cp "$src"/state.* voice-state/
    git add voice-state
    git commit -q -m "$message"
    commit=$(git rev-parse HEAD)
    git rm -q -r voice-state
    cat > "$REF" <<EOF
# The commit whose voice-state/ holds the voice's training state (issue 35); restore it with
# bash bench/voice_state.sh restore (into .voicestate/). Written by bench/voice_state.sh store.
commit $commit
EOF
    git add "$REF"
    git commit -q -m "voice-state.ref: the parts of ${commit:0:7} leave the tree (history keeps them)"
    echo "stored in $commit; $REF names it"
    ;;
  *)
    echo "unknown verb $verb: restore or store" >&2; exit 2 ;;
esac

# `make help` / `make help-all` (the Makefile runs it on itself): targets grouped under the Makefile's `##@ <group>:`
# headings, in their order. `target: ... ## <group>: what it does` is listed by both; `### <group>: ...` by help-all
# only, so that the front door stays short while every target keeps its line. awk, not Python: it runs before venv.
/^##@ [a-z]+:/ {
  group = substr($2, 1, length($2) - 1)
  order[++groups] = group
  title[group] = substr($0, 5)
  next
}
/^[a-z][a-z0-9-]*:[^#]*##+ [a-z]+: / {
  at = index($0, "## ")
  hidden = substr($0, at - 1, 1) == "#"
  if (hidden && !all) next
  rest = substr($0, at + 3)
  group = substr(rest, 1, index(rest, ":") - 1)
  listed[group] = listed[group] sprintf("  %-18s %s\n", substr($0, 1, index($0, ":") - 1), substr(rest, length(group) + 3))
}
END {
  for (i = 1; i <= groups; i++) if (listed[order[i]] != "") printf "%s\n%s", title[order[i]], listed[order[i]]
  if (!all) print "\nmake help-all: every target, the benches and the tools included"
}

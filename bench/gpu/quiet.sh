# Sourced by the H200 scripts: `quiet` drops torch's warnings (Inductor's online-softmax notice is
# several lines) and blank lines from a log.
quiet() { grep -v -i "warn\|online softmax\|split the reduction\|important use case\|^softmax\.$\|^$"; }

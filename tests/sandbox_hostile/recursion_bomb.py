# expect: RecursionError|exit code|killed by|CPU time limit|memory limit|wall time limit
import sys
sys.setrecursionlimit(10**8)
def f(n):
    return f(n + 1)
f(0)

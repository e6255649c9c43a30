"""Examples for the commands whose own help has none, shown at the end of their `--help`.

Every command's help ends with examples (a snapshot test keeps it so); commands with longer
examples carry them in their own module's epilog or docstring.
"""

from __future__ import annotations

EXAMPLES: dict[str, tuple[str, ...]] = {
    "": ("apirctl setup", "apirctl serve smollm2", "apirctl run smollm2", "apirctl chat 'Hello'",
         "apirctl doctor"),
    "version": ("apirctl version",),
    "ps": ("apirctl ps", "apirctl ps --all --json", "apirctl ps --stats"),
    "gpu": ("sudo apirctl gpu cdi", "apirctl gpu cdi --print"),
    "gpu cdi": ("sudo apirctl gpu cdi", "apirctl gpu cdi --print",
                "sudo apirctl gpu cdi --output /var/run/cdi/apirctl-nvidia.yaml"),
    "logs": ("apirctl logs", "apirctl logs apirctl-smollm2 -f", "apirctl logs apirctl-smollm2 --tail 20"),
    "stop": ("apirctl stop", "apirctl stop apirctl-smollm2", "apirctl stop --all"),
    "restart": ("apirctl restart", "apirctl restart apirctl-smollm2 --json"),
    "uninstall": ("apirctl uninstall", "apirctl uninstall b6298-remoting-0.1.6_b5 --json"),
    "setup": ("apirctl setup", "apirctl setup -j 4", "apirctl setup --no-model --json"),
    "doctor": ("apirctl doctor", "apirctl doctor --json"),
    "info": ("apirctl info", "apirctl info --report", "apirctl info --json"),
    "machine": ("apirctl machine status", "apirctl machine restart --remoting", "apirctl machine logs -f"),
    "machine status": ("apirctl machine status", "apirctl machine status --json; echo $?"),
    "machine restart": ("apirctl machine restart --remoting   # a private Unix socket (Linux)",
                        "apirctl machine restart --remoting --listen tcp --port 50060   # for SSH tunnels",
                        "apirctl machine restart   # without remoting"),
    "machine stop": ("apirctl machine stop",),
    "machine logs": ("apirctl machine logs", "apirctl machine logs -f --tail 100"),
    "bench history": ("apirctl bench history", "apirctl bench history --model smollm2 --limit 5 --json"),
    "bench compare": ("apirctl bench compare 3 7", "apirctl bench compare 3 7 --json"),
    "models aliases": ("apirctl models aliases", "apirctl config set model_aliases.mine hf.co/ORG/REPO:Q4_K_M"),
    "backend": ("apirctl backend selftest", "apirctl backend probe --json"),
    "backend selftest": ("apirctl backend selftest", "apirctl backend selftest --calls 10000 --json"),
    "backend probe": ("apirctl backend probe", "apirctl backend probe --json"),
    "config": ("apirctl config show", "apirctl config set port 8080", "apirctl config unset port"),
    "config show": ("apirctl config show", "apirctl config show --json"),
    "config set": ("apirctl config set port 8080", "apirctl config set default_model llama3.2:1b"),
    "config unset": ("apirctl config unset port",),
    "config edit": ("apirctl config edit", "EDITOR=nano apirctl config edit"),
    "apir": ("apirctl apir table", "apirctl apir generate --out include/", "apirctl apir check"),
    "apir generate": ("apirctl apir generate --out include/",),
    "apir check": ("apirctl apir check", "apirctl apir check --source ~/src/llama.cpp --json"),
    "apir table": ("apirctl apir table", "apirctl apir table --markdown"),
    "resident": ("apirctl resident status", "apirctl resident stop"),
    "resident status": ("apirctl resident status", "apirctl resident status --json"),
    "resident stop": ("apirctl resident stop",),
}


def epilog(path: str) -> str | None:
    """The examples paragraph for a command (`path` like "machine restart"), or None."""
    lines = EXAMPLES.get(path)
    if not lines:
        return None
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)

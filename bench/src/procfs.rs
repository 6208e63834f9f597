//! What the benchmark reads of other processes in /proc: CPU seconds,
//! resident memory, and which processes are the broker's.

/// utime + stime of a process in seconds.
pub(crate) fn cpu_secs(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some((_, after)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let f: Vec<&str> = after.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / 100.0
}

pub(crate) fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/statm"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * 4096
}

/// Pids whose command name is `comm` (beam.smp, postgres).
pub(crate) fn pids(comm: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim() == comm)
                .unwrap_or(false)
        })
        .collect()
}

/// The broker's Erlang VM: the `beam.smp` that boots `rabbit`. Not every
/// `beam.smp`: each `rabbitmqctl` call (ours, or anyone's on the machine) runs
/// one for a moment, and its CPU would enter one reading and leave the next.
pub(crate) fn broker_pids() -> Vec<u32> {
    pids("beam.smp")
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                    args.windows(2)
                        .any(|w| w[0] == b"rabbit" && w[1] == b"boot")
                })
                .unwrap_or(false)
        })
        .collect()
}

/// The broker's CPU seconds so far.
pub(crate) fn broker_cpu() -> f64 {
    broker_pids().into_iter().map(cpu_secs).sum()
}

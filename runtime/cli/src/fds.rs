//! The process's file descriptor limit, raised to what the system allows.
//!
//! Every connection is a descriptor: the frontend's clients, the transfer listeners' peers
//! (up to 1,024 each), a pooled shared-memory connection's socket and memfd. A soft limit of
//! 1,024 (systemd's and most shells' default) runs out before those bounds do, and then no
//! listener of the process can accept at all. The hard limit is the administrator's; the
//! soft one is the process's to raise up to it, as Go's runtime and nginx's workers do.

use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// Raises the soft limit on open files to the hard limit; returns the limit now in force.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(getrlimit(Resource::RLIMIT_NOFILE)?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lowered below the hard limit, the soft limit comes back up to it.
    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let low = hard.min(512);
        setrlimit(Resource::RLIMIT_NOFILE, low, hard).unwrap();
        assert_eq!(raise_open_files_limit().unwrap(), hard);
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
    }
}

use super::{ThreadsCpu, current_tid, thread_cpu};

/// This thread's CPU grows as it works, and a reading skips the threads it is told to by
/// name. The loop ends once the kernel has counted some of the work (at its next tick at
/// the latest); its bound only stops a broken reading from spinning for ever.
#[test]
fn a_threads_own_work_is_counted_and_threads_are_skipped_by_name() {
    let tid = current_tid().unwrap();
    let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap();
    // `before` read after `all`: once this thread's time passes `before` it has passed what
    // `all` read of it too (read the other way round, a scheduler tick between the two reads
    // left the thread's time in `all` where the loop below stops: nothing used).
    let all = ThreadsCpu::read(&[]).unwrap();
    let before = thread_cpu(tid).unwrap();
    let mut x = 0u64;
    let mut grew = false;
    for i in 0..20_000_000u64 {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
        if i % 1000 == 0 && thread_cpu(tid).unwrap() > before {
            grew = true;
            break;
        }
    }
    assert!(grew, "this thread's CPU never grew");
    let since = ThreadsCpu::read(&[]).unwrap().since(&all);
    assert!(since > std::time::Duration::ZERO, "the process's threads used nothing");
    assert!(all.0.contains_key(&tid), "this thread is read when nothing is skipped");
    let skipped = ThreadsCpu::read(&[name.trim()]).unwrap();
    assert!(!skipped.0.contains_key(&tid), "this thread is skipped by its name");
}

use super::*;

#[test]
fn renders_every_kind_in_the_text_format() {
    let r = Registry::new();
    let c = r.counter("a_total", "things");
    let g = r.gauge("b", "level");
    let l = r.level("b_depth", "depth");
    let h = r.histogram("c_seconds", "time", &[0.1, 1.0]);
    let f = r.counters("d_total", "by reason", &["reason"]);
    let hf = r.histograms("e_seconds", "by stage", &["stage"], &[1.0]);
    c.add(3);
    g.set(2.5);
    l.inc();
    l.inc();
    l.dec();
    h.observe(0.05);
    h.observe(0.5);
    h.observe(7.0);
    f.with(&["a \"quoted\"\nline"]).inc();
    hf.with(&["verify"]).observe_duration(Duration::from_millis(500));
    let text = r.render();
    let expected = [
        "# HELP a_total things\n# TYPE a_total counter\na_total 3\n",
        "# TYPE b gauge\nb 2.5\n",
        "# TYPE b_depth gauge\nb_depth 1\n",
        "c_seconds_bucket{le=\"0.1\"} 1\nc_seconds_bucket{le=\"1\"} 2\nc_seconds_bucket{le=\"+Inf\"} 3\nc_seconds_sum 7.55\nc_seconds_count 3\n",
        "d_total{reason=\"a \\\"quoted\\\"\\nline\"} 1\n",
        "e_seconds_bucket{stage=\"verify\",le=\"1\"} 1\ne_seconds_bucket{stage=\"verify\",le=\"+Inf\"} 1\ne_seconds_sum{stage=\"verify\"} 0.5\ne_seconds_count{stage=\"verify\"} 1\n",
    ];
    for e in expected {
        assert!(text.contains(e), "missing {e:?} in\n{text}");
    }
}

#[test]
fn a_value_on_a_bound_falls_in_that_bucket() {
    let h = Histogram::new(&[1.0, 2.0]);
    h.observe(1.0);
    h.observe(f64::NAN);
    let mut out = String::new();
    h.write("x", "", &mut out);
    assert!(out.contains("x_bucket{le=\"1\"} 2\n"), "{out}");
    assert_eq!(h.count(), 2);
}

#[test]
fn families_are_bounded_and_forget_what_they_are_told_to() {
    let r = Registry::new();
    let f = r.gauges("g", "per instance", &["instance"]);
    for i in 0..MAX_SERIES + 10 {
        f.with(&[&i.to_string()]).set(1.0);
    }
    let text = r.render();
    assert_eq!(text.lines().filter(|l| l.starts_with("g{")).count(), MAX_SERIES + 1);
    assert!(text.contains("g{instance=\"_other\"} 1"), "overflow shares one series");
    f.remove(&["0"]);
    assert!(!r.render().contains("g{instance=\"0\"}"));
    f.clear();
    assert!(!r.render().contains("g{"));
    // Counts set afresh at each scrape add: what shares `_other` is summed there, not the
    // last one written (at a thousand instances, their outcome counts jumped up and down).
    let t = r.tallies("t_total", "per instance", &["instance"]);
    for i in 0..MAX_SERIES + 10 {
        t.with(&[&i.to_string()]).add(i as u64);
    }
    let other: u64 = (MAX_SERIES..MAX_SERIES + 10).map(|i| i as u64).sum();
    assert!(r.render().contains(&format!("t_total{{instance=\"_other\"}} {other}\n")));
    f.with(&["a"]).add(2.5);
    f.with(&["a"]).add(1.0);
    assert_eq!(f.with(&["a"]).get(), 3.5);
}

#[test]
fn concurrent_observations_all_count() {
    let h = Arc::new(Histogram::new(LATENCY_BUCKETS));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let h = h.clone();
            std::thread::spawn(move || {
                for _ in 0..10_000 {
                    h.observe(0.001);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(h.count(), 40_000);
    assert!((h.sum() - 40.0).abs() < 1e-6, "{}", h.sum());
}

#[test]
fn a_series_is_found_by_its_values_whatever_their_lengths() {
    let r = Registry::new();
    let f = r.counters("k_total", "two labels", &["a", "b"]);
    let ab = f.with(&["a", "b"]);
    let abb = f.with(&["a", "bb"]);
    let a_b = f.with(&["ab", ""]);
    assert!(Arc::ptr_eq(&ab, &f.with(&["a", "b"])), "the same series, found again");
    assert!(!Arc::ptr_eq(&ab, &abb) && !Arc::ptr_eq(&ab, &a_b), "values are not concatenated");
    f.remove(&["a", "bb"]);
    let text = r.render();
    assert!(text.contains("k_total{a=\"a\",b=\"b\"} 0") && !text.contains("b=\"bb\""), "{text}");
}

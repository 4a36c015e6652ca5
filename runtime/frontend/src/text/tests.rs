use handoff_engine::{MockConfig, MockEngine};

use super::*;

#[test]
fn stop_strings_spanning_tokens_are_held_back_and_never_sent() {
    let e = MockEngine::new(MockConfig::default());
    // The mock renders token t as " w<t>".
    let mut a = TextAssembler::new(&["w12 w3".to_owned()]);
    let mut sent = String::new();
    let mut stopped = false;
    for t in [7, 12, 3, 9] {
        let r = a.push(&e, t);
        sent.push_str(&r.text);
        if r.stopped {
            stopped = true;
            break;
        }
    }
    assert!(stopped);
    assert_eq!(sent, " w7 ");
}

#[test]
fn without_stops_everything_is_released() {
    let e = MockEngine::new(MockConfig::default());
    let mut a = TextAssembler::new(&[]);
    let mut sent: String = [5, 6].iter().map(|&t| a.push(&e, t).text).collect();
    sent.push_str(&a.finish());
    assert_eq!(sent, " w5 w6");
    assert_eq!(a.released(), " w5 w6");
}

/// Held-back text is searched for stop strings from a character's start: accented and CJK
/// text (several bytes a character) with a stop string of two bytes or more.
#[test]
fn stop_strings_are_found_in_text_of_any_script() {
    for (steps, stop, expected) in [
        (&["Tr", "Très", "Très b", "Très bien\n\nAu"][..], "\n\n", "Très bien"),
        (&["日", "日本", "日本語", "日本語です</s>x"][..], "</s>", "日本語です"),
        (&["ü", "üü", "üüü"][..], "üü", ""),
    ] {
        let mut a = TextAssembler::new(&[stop.to_owned()]);
        let mut sent = String::new();
        let mut stopped = false;
        for step in steps {
            let r = a.release(step.to_string());
            sent.push_str(&r.text);
            stopped |= r.stopped;
            if r.stopped {
                break;
            }
        }
        assert!(stopped, "{steps:?} stops at {stop:?}");
        assert_eq!(sent, expected);
        assert_eq!(a.released(), expected);
    }
}

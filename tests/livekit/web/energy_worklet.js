// AudioWorklet of tests/livekit/web/index.html: tells the page each time the agent's decoded
// track (after the browser's jitter buffer, as the <audio> element plays it) turns loud or quiet,
// with the context frame where it did, so gaps are counted in playout samples.
const THRESHOLD = 200 / 32768; // the RMS the Python participant counts as speech (int16 200)

class EnergyProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.loud = false;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      let sum = 0;
      for (let i = 0; i < channel.length; i++) sum += channel[i] * channel[i];
      const loud = Math.sqrt(sum / channel.length) > THRESHOLD;
      if (loud !== this.loud) {
        this.loud = loud;
        this.port.postMessage({ loud, frame: currentFrame });
      }
    }
    return true;
  }
}

registerProcessor("energy", EnergyProcessor);

from weightsync.integrations.swift import register_callback

register_callback()
